"""The Responses API (POST /v1/responses and the stored responses' routes), without model processes:
the app in-process with a TokenizerManager that answers with scripted outputs (test_openai_protocol's
_scripted_client), and the translation to a chat request on its own."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
from fastapi.testclient import TestClient

from test_openai_protocol import _make_tm, _out, _scripted_client, _sse_events

from minisgl.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from minisgl.entrypoints.openai.responses_convert import BadResponsesRequest, to_chat_request
from minisgl.entrypoints.openai.responses_protocol import ResponsesRequest
from minisgl.entrypoints.openai.serving_responses import OpenAIServingResponses
from minisgl.entrypoints.http_server import create_app
from minisgl.managers.tokenizer_manager import ReqAbortedError
from minisgl.utils import ParamError, get_tokenizer

STOP = {"type": "stop", "matched": 2}
LENGTH = {"type": "length", "length": 2}
THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello there!"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
FORCED = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
# the tiny model's template, plus an assistant's tool calls and the reasoning_effort variable
TOOLS_TEMPLATE = (
    "{% if reasoning_effort %}{{ 'effort=' + reasoning_effort + '\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{{ '<call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) + '</call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _client(tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]], template: Optional[str] = None, **args: Any) -> Tuple[TestClient, List[Any]]:
    """A scripted server (ServerArgs `args` changed); `template`: its tokenizer's chat template instead (--chat-template)."""
    return _scripted_client(tiny_model, tmp_path, outs, args=args, template=template)


def _create(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/responses", json={"model": client.model, "input": "hi", **body})


_events = _sse_events  # (event name, data) of each SSE event of a Responses stream


# --------------------------------------------------------------------------- translation
def _translate(**body: Any) -> Any:
    return to_chat_request(ResponsesRequest.model_validate({"model": "m", **body}), "resp_x", [])


def test_a_string_input_with_instructions_is_a_system_then_a_user_message() -> None:
    chat, conversation, items = _translate(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]  # fmt: skip
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.rid) == (7, 0.5, 0.9, "resp_x")
    assert conversation == [{"role": "user", "content": "Hi"}]  # (the instructions are not carried over)
    assert items[0]["type"] == "message" and items[0]["content"] == [{"type": "input_text", "text": "Hi"}]


def test_input_items_become_chat_messages_with_the_calls_joined_to_their_turn() -> None:
    chat, _, items = _translate(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"}, {"type": "input_text", "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}], "id": "msg_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert chat.messages[1].text() == "Weather in Oslo?"  # (parts joined as chat joins them)
    assistant = messages[2]
    assert (chat.messages[2].text(), assistant["reasoning_content"]) == ("Let me look.", "Call it.")
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:]] == [("call_1", "sunny"), ("call_2", "rain")]
    assert [i["id"] for i in items][2:4] == ["rs_1", "msg_1"] and all(i["id"] for i in items)  # (the client's ids kept)


def test_function_tools_tool_choice_and_text_format_take_chats_shapes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat, _, _ = _translate(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                            text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})  # fmt: skip
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert _translate(input="x", text={"format": {"type": "json_object"}})[0].response_format.grammar() == {"json_schema": '{"type": "object"}'}
    logprobs = _translate(input="x", include=["message.output_text.logprobs"], top_logprobs=3)[0]
    assert (logprobs.logprobs, logprobs.top_logprobs) == (True, 3)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "answers no function_call"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_image parts are not supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' are not supported"),
        ({"input": [{"type": "reasoning", "summary": [], "content": []}, {"role": "user", "content": "x"}]}, "reasoning item goes right before"),
        ({"input": []}, "input is empty"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "'web_search' tools are not supported"),
        ({"input": "x", "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "allowed_tools"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)
def test_what_cannot_be_translated_says_what_to_send(body: Dict[str, Any], needle: str) -> None:
    with pytest.raises(BadResponsesRequest, match=needle.replace("[", r"\[").replace("(", r"\(")):
        _translate(**body)


# --------------------------------------------------------------------------- the response object
def test_a_response_has_the_sdks_shape_and_echoes_the_settings(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "Hello!", 4, STOP)])
    with client:
        r = _create(client, instructions="Be kind.", max_output_tokens=9, temperature=0.3, metadata={"k": "v"}, stream=False)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert seen[0].rid == body["id"] and seen[0].sampling_params["max_new_tokens"] == 9
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Hello!", "annotations": []}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 3},
                             "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}  # fmt: skip
    assert (body["instructions"], body["max_output_tokens"], body["temperature"], body["metadata"]) == ("Be kind.", 9, 0.3, {"k": "v"})
    assert (body["store"], body["tool_choice"], body["text"], body["incomplete_details"]) == (True, "auto", {"format": {"type": "text"}}, None)
    from openai.types.responses import Response

    assert Response.model_validate(body).output_text == "Hello!"  # (the SDK's own type reads it, strictly)


def test_max_output_tokens_reached_is_an_incomplete_response(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "Hel", 2, LENGTH)])
    with client:
        body = _create(client, max_output_tokens=2).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_reasoning_logprobs_and_a_forced_call_become_their_output_items(tiny_model: str, tmp_path: Any) -> None:
    out = _out("r", THOUGHT, 3, STOP)
    out["meta_info"].update(output_token_logprobs=[(-0.5, 5, None)], output_top_logprobs=[[(-0.5, 5, None), (-1.5, 6, None)]])
    client, _ = _client(tiny_model, tmp_path, [out], reasoning_parser="qwen3")
    with client:
        body = _create(client, include=["message.output_text.logprobs"], top_logprobs=2).json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "The user greets me."}]
    assert message["content"][0]["text"] == "Hello there!"
    (token,) = message["content"][0]["logprobs"]
    assert token["logprob"] == -0.5 and [t["logprob"] for t in token["top_logprobs"]] == [-0.5, -1.5] and token["bytes"]
    assert 0 < body["usage"]["output_tokens_details"]["reasoning_tokens"] <= 3
    client, _ = _client(tiny_model, tmp_path, [_out("r", FORCED, 9, STOP)])
    with client:
        body = _create(client, tools=[WEATHER], tool_choice="required").json()
    (call,) = body["output"]  # (a call and no text: no message)
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather", {"city": "Oslo"})
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")


# --------------------------------------------------------------------------- streaming
def test_a_stream_sends_openais_events_in_order_and_they_add_up(tiny_model: str, tmp_path: Any) -> None:
    pieces = ["<think>\nThe user ", "greets me.\n</th", "ink>\n\nHello", " there!"]
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs, reasoning_parser="qwen3")
    with client:
        r = _create(client, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [name for name, _ in events]
    item = ["response.output_item.added", "response.content_part.added"]
    assert kinds == ["response.created", "response.in_progress",
                     *item, *["response.reasoning_text.delta"] * kinds.count("response.reasoning_text.delta"),
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     *item, *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    data = {name: d for name, d in events}  # (the last of each)
    text = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
    reasoning = "".join(d["delta"] for name, d in events if name == "response.reasoning_text.delta")
    assert (text, reasoning) == ("Hello there!", "The user greets me.")
    assert data["response.output_text.done"]["text"] == text and data["response.reasoning_text.done"]["text"] == reasoning
    final = data["response.completed"]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 4
    assert data["response.created"]["response"]["status"] == "in_progress" and data["response.created"]["response"]["output"] == []


def test_a_streamed_forced_call_sends_its_arguments_as_deltas(tiny_model: str, tmp_path: Any) -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": ', '"Oslo"}}]']
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        events = _events(_create(client, stream=True, tools=[WEATHER], tool_choice="required"))
    kinds = [name for name, _ in events]
    assert kinds[2] == "response.output_item.added" and events[2][1]["item"]["type"] == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = "".join(d["delta"] for name, d in events if name == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Oslo"} == json.loads(events[-3][1]["arguments"])
    assert events[-1][1]["response"]["output"][0]["arguments"] == arguments


def test_a_stream_cut_by_max_output_tokens_ends_incomplete_and_a_refused_one_with_an_error_event(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "lo", 2, LENGTH)])
    with client:
        events = _events(_create(client, stream=True, max_output_tokens=2))
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    client, _ = _client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "", 1, {"type": "abort"})])
    with client:
        events = _events(_create(client, stream=True))  # (aborted without a status: /abort_request)
    assert events[-1][0] == "response.failed" and events[-1][1]["response"]["error"]["code"] == "server_error"
    refused = {"type": "abort", "status_code": 503, "message": "The queue is full"}
    client, _ = _client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        events = _events(_create(client, stream=True))
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1][1] == {"type": "error", "code": "503", "message": "The queue is full", "param": None, "sequence_number": 2}


# --------------------------------------------------------------------------- store and continuation
def test_stored_responses_are_retrieved_listed_continued_and_deleted(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", FORCED, 9, STOP)], template=TOOLS_TEMPLATE)
    with client:
        first = _create(client, input=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required").json()
        call = first["output"][0]
        assert client.get(f"/v1/responses/{first['id']}").json() == first
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        second = _create(client, input=[answer], previous_response_id=first["id"], instructions="Answer.", store=False)
        assert second.status_code == 200, second.text
        # the earlier turn and its call, then the tool's answer (the new instructions first)
        prompt = seen[1].text
        assert prompt.startswith("<|im_start|>system\nAnswer.") and prompt.index("Weather?") < prompt.index("<call>get_weather") < prompt.index("sunny")
        assert client.get(f"/v1/responses/{second.json()['id']}").status_code == 404  # (store: false)
        listed = client.get(f"/v1/responses/{first['id']}/input_items").json()
        assert listed["object"] == "list" and [i["content"][0]["text"] for i in listed["data"]] == ["Weather?"] and not listed["has_more"]
        cancel = client.post(f"/v1/responses/{first['id']}/cancel")
        assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
        assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        gone = client.get(f"/v1/responses/{first['id']}")
        again = _create(client, input=[answer], previous_response_id=first["id"])
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    assert again.status_code == 404 and again.json()["error"]["param"] == "previous_response_id" and "not found" in again.json()["error"]["message"]


def test_input_items_pages_newest_first_by_default(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "ok", 1, STOP)])
    with client:
        rid = _create(client, input=[{"role": "user", "content": t} for t in "abc"]).json()["id"]
        page = client.get(f"/v1/responses/{rid}/input_items?limit=2").json()
        rest = client.get(f"/v1/responses/{rid}/input_items?limit=2&after={page['last_id']}").json()
        asc = client.get(f"/v1/responses/{rid}/input_items?order=asc").json()
        bad = client.get(f"/v1/responses/{rid}/input_items?limit=0")
        replay = client.get(f"/v1/responses/{rid}?stream=true")  # (OpenAI's replay of a stored stream: not built)
    text = lambda p: [i["content"][0]["text"] for i in p["data"]]  # noqa: E731
    assert (text(page), page["has_more"], text(rest), rest["has_more"], text(asc)) == (["c", "b"], True, ["a"], False, ["a", "b", "c"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_the_store_forgets_the_oldest_beyond_its_capacity() -> None:
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(StoredResponse({"id": f"resp_{i}"}, [], []))
    assert (store.get("resp_0"), len(store)) == (None, 2) and store.get("resp_2") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "body, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"user": "u1"}, "user"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
        ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        # the chat path's errors, by the Responses' names
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (the tiny model's template reads no reasoning_effort)
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tools"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": 3}, "input"),  # (not pydantic's union branches, input.str / input.list[any])
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{bad"},
                    {"type": "function_call_output", "call_id": "c1", "output": "x"}], "tools": [WEATHER]}, "input[0].arguments"),
        ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"role": "user", "content": "q2"}], "tools": [WEATHER]}, "input"),
        ({"input": [{"type": "reasoning", "summary": [{"junk": 1}]}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "b"}]}, "input"),
    ],
)
def test_what_is_not_built_is_a_400_that_names_the_field(tiny_model: str, tmp_path: Any, body: Dict[str, Any], param: Optional[str]) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        r = _create(client, **body)
        ok = _create(client)  # (and the server goes on serving)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param and error["message"]
    # (the message speaks of what the client sent, never of chat's fields)
    assert not any(word in error["message"] for word in ("max_completion_tokens", "reasoning_effort", "response_format", "input.str"))
    assert ok.status_code == 200 and len(seen) == 1


def test_the_messages_of_what_the_chat_path_refuses_name_the_responses_fields(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        messages = {name: _create(client, **body).json()["error"] for name, body in [
            ("too many", {"max_output_tokens": 100000}), ("effort", {"reasoning": {"effort": "high"}}),
            ("call without output", {"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                                               {"role": "user", "content": "q"}], "tools": [WEATHER]}),
        ]}  # fmt: skip
    assert messages["too many"]["message"].startswith("max_output_tokens is too large: 100000")
    assert messages["effort"]["message"].startswith("reasoning.effort is not used by this model's chat template")
    assert messages["call without output"]["message"].startswith("No tool output found for function call c1")


@pytest.mark.parametrize(
    "error, body, param",
    [  # what the TokenizerManager and the scheduler raise, after the chat path's own checks: the
       # field by /generate's name, the message reworded (the param never comes from the text)
        (ParamError("reworded: no field named here", "top_k"), {"top_k": 0}, "top_k"),
        (ParamError("reworded: no field named here", "text"), {}, "input"),
        (ReqAbortedError("reworded: no field named here", 400, "json_schema"),
         {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}}, "text.format"),
        (ReqAbortedError("reworded: no field named here", 400, "json_schema"), {"tools": [WEATHER], "tool_choice": "required"}, "tools"),
        (ValueError("top_k is too large"), {"top_k": 5}, None),  # (no param given: none guessed from the words)
    ],
)
def test_errors_found_after_the_translation_name_the_responses_field(tiny_model: str, tmp_path: Any, error: Exception, body: Dict[str, Any],
                                                                     param: Optional[str]) -> None:  # fmt: skip
    tm = _make_tm(tiny_model, tmp_path)

    async def refuse(obj: Any, request: Any = None) -> Any:
        raise error
        yield  # (a generator, as generate_request)

    tm.generate_request = refuse  # type: ignore[method-assign]
    with TestClient(create_app(tm.server_args, tm, is_healthy=lambda: True)) as client:
        client.model = tm.model_name  # type: ignore[attr-defined]
        plain, streamed = _create(client, **body), _create(client, stream=True, **body)
    assert plain.status_code == 400 and plain.json()["error"]["param"] == param
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == param


def test_a_grammar_refused_in_a_stream_names_the_responses_field_in_its_error_event(tiny_model: str, tmp_path: Any) -> None:
    refused = {"type": "abort", "status_code": 400, "message": "reworded: no field named here", "param": "json_schema"}
    client, _ = _client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        events = _events(_create(client, stream=True, text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}))
    assert events[-1][0] == "error" and events[-1][1]["param"] == "text.format"


def test_reasoning_effort_reaches_a_template_that_reads_it(tiny_model: str, tmp_path: Any) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)], template=TOOLS_TEMPLATE)
    with client:
        body = _create(client, reasoning={"effort": "low"}).json()
    assert seen[0].text.startswith("effort=low\n") and body["reasoning"] == {"effort": "low", "summary": None}


def test_an_unknown_model_is_a_404(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        r = client.post("/v1/responses", json={"model": "gpt-nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# --------------------------------------------------------------------------- review fixes: logprobs, statuses, store bytes, usage
def _tokens_out(tokenizer: Any, pieces: List[str], finish: Any) -> List[Dict[str, Any]]:
    """One output per piece, each with the real ids of its text and a logprob per token (the k-th token: -k)."""
    outs, k = [], 0
    for i, piece in enumerate(pieces):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        out = _out("r", piece, k + len(ids), finish if i == len(pieces) - 1 else None)
        out["meta_info"]["output_token_logprobs"] = [(-float(k + j), tid, None) for j, tid in enumerate(ids)]
        out["meta_info"]["output_top_logprobs"] = [[(-float(k + j), tid, None)] for j, tid in enumerate(ids)]
        outs.append(out)
        k += len(ids)
    return outs


def _whole(outs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The outputs of a stream as the one output of the same request not streamed."""
    whole = json.loads(json.dumps(outs[-1]))
    whole["text"] = "".join(o["text"] for o in outs)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        whole["meta_info"][key] = [t for o in outs for t in o["meta_info"][key]]
    return whole


def test_reasoning_with_logprobs_gives_one_reasoning_and_one_message_of_the_answers_tokens_streamed_or_not(tiny_model: str, tmp_path: Any) -> None:
    tokenizer = get_tokenizer(tiny_model)
    pieces = ["<think>\n", "I think", " hard", "\n</think>\n\n", "Hello", " there"]
    outs = _tokens_out(tokenizer, pieces, STOP)
    first_answer = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in pieces[:4])
    answer = [-float(k) for k in range(first_answer, outs[-1]["meta_info"]["completion_tokens"])]  # the tokens of "Hello there"
    body = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    client, _ = _client(tiny_model, tmp_path, outs, reasoning_parser="qwen3")
    with client:
        final = _events(_create(client, stream=True, **body))[-1][1]["response"]
    client, _ = _client(tiny_model, tmp_path, [_whole(outs)], reasoning_parser="qwen3")
    with client:
        whole = _create(client, **body).json()
    for response in (final, whole):
        assert [(i["type"], i["status"]) for i in response["output"]] == [("reasoning", "completed"), ("message", "completed")]
        reasoning, message = response["output"]
        assert reasoning["content"][0]["text"] == "I think hard" and message["content"][0]["text"] == "Hello there"
        assert [t["logprob"] for t in message["content"][0]["logprobs"]] == answer
        assert "".join(t["token"] for t in message["content"][0]["logprobs"]) == "Hello there"


def test_a_cut_streamed_call_is_incomplete_and_its_response_can_be_continued(tiny_model: str, tmp_path: Any) -> None:
    pieces = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Zü']
    outs = [_out("r", p, i + 1, LENGTH if i == 1 else None) for i, p in enumerate(pieces)]
    client, seen = _client(tiny_model, tmp_path, outs, template=TOOLS_TEMPLATE, tool_call_parser="qwen25")
    with client:
        events = _events(_create(client, stream=True, input="w?", tools=[WEATHER]))
        final = events[-1][1]["response"]
        assert events[-1][0] == "response.incomplete"
        calls = [i for i in final["output"] if i["type"] == "function_call"]
        assert calls and all(c["status"] == "incomplete" for c in calls)
        done = [d["item"] for name, d in events if name == "response.output_item.done" and d["item"]["type"] == "function_call"]
        assert done[-1]["status"] == "incomplete"
        assert client.get(f"/v1/responses/{final['id']}").json()["output"] == final["output"]
        again = _create(client, input="go on", previous_response_id=final["id"])
    assert again.status_code == 200, again.text
    prompt = seen[-1].text  # (the cut answer's text, as the chat path answers it, and no call)
    assert '"city": "Zü' in prompt and "<call>" not in prompt


def test_an_aborted_response_has_no_completed_item(tiny_model: str, tmp_path: Any) -> None:
    aborted = [_out("r", "Hel", 1), _out("r", "lo", 2, {"type": "abort"})]
    client, _ = _client(tiny_model, tmp_path, aborted)
    with client:
        streamed = _events(_create(client, stream=True))[-1][1]["response"]
    client, _ = _client(tiny_model, tmp_path, [{**aborted[-1], "text": "Hello"}])
    with client:
        whole = _create(client).json()
    for response in (streamed, whole):
        assert response["status"] == "failed" and [i["status"] for i in response["output"]] == ["incomplete"]


def test_the_store_is_bounded_by_bytes_too() -> None:
    def entry(i: int, size: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}", "text": "x" * size}, [], [])

    store = ResponseStore(capacity=100, max_bytes=2500)
    for i in range(3):
        assert store.put(entry(i, 1000))
    assert store.get("resp_0") is None and store.get("resp_1") is not None and store.bytes <= 2500  # (the oldest went)
    assert store.get("resp_2").response["text"] == "x" * 1000
    assert not store.put(entry(9, 5000))  # (alone over the bound: not stored, the others kept)
    assert store.get("resp_9") is None and store.too_large("resp_9") > 5000 and len(store) == 2


def test_a_response_too_large_to_store_is_a_404_that_says_why() -> None:
    serving = OpenAIServingResponses.__new__(OpenAIServingResponses)  # (its lookup alone: no chat path needed)
    serving.store = ResponseStore(max_bytes=100)
    serving.store.put(StoredResponse({"id": "resp_big", "text": "x" * 200}, [], []))
    r = serving._stored("resp_big", "response_id")
    assert r.status_code == 404 and "more than the 100 bytes" in json.loads(r.body)["error"]["message"]


def test_cache_write_tokens_are_the_uncached_prompt_tokens_and_none_without_the_radix_cache(tiny_model: str, tmp_path: Any) -> None:
    out = _out("r", "Hi", 1, STOP)
    out["meta_info"].update(prompt_tokens=10, cached_tokens=4)
    written = []
    for disable in (False, True):
        client, _ = _client(tiny_model, tmp_path, [out], disable_radix_cache=disable)
        with client:
            written.append(_create(client).json()["usage"]["input_tokens_details"])
    assert written == [{"cached_tokens": 4, "cache_write_tokens": 6}, {"cached_tokens": 4, "cache_write_tokens": 0}]
