"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens), without model processes:
the app in-process with a TokenizerManager that answers with scripted outputs (test_openai_protocol's
_scripted_client), the translation to a chat request on its own, and the answers read by the
`anthropic` SDK's own types."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from test_openai_protocol import _out, _scripted_client, _sse_events

from minisgl.entrypoints.anthropic.convert import thinking_template_kwargs, to_chat_request
from minisgl.entrypoints.anthropic.protocol import BadMessagesRequest, MessagesRequest
from minisgl.utils import get_tokenizer

STOP = {"type": "stop", "matched": 2}
LENGTH = {"type": "length", "length": 2}
THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello there!"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
FORCED = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
# the tiny model's template, plus an assistant's tool calls, its reasoning, and the enable_thinking switch
TOOLS_TEMPLATE = (
    "{% if enable_thinking is defined %}{{ 'thinking=' + (enable_thinking | string) + '\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['reasoning_content'] %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{{ '<call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) + '</call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EVENTS = TypeAdapter(RawMessageStreamEvent)


def _client(tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]], template: Optional[str] = None, **args: Any) -> Tuple[Any, List[Any]]:
    """A scripted server (ServerArgs `args` changed); `template`: its tokenizer's chat template instead (--chat-template)."""
    return _scripted_client(tiny_model, tmp_path, outs, args=args, template=template)


def _create(client: Any, headers: Optional[Dict[str, str]] = None, **body: Any) -> Any:
    full = {"model": client.model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **body}
    return client.post("/v1/messages", json=full, headers={"anthropic-version": "2023-06-01", **(headers or {})})


def _events(r: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """(event name, data) of each SSE event, each data read by the SDK's event type (but `error`)."""
    events = _sse_events(r)
    for name, body in events:
        assert body["type"] == name
        if name != "error":
            EVENTS.validate_python(body)
    return events


def _assert_error(r: Any, status: int, kind: str, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    ErrorResponse.model_validate(body)
    assert body["type"] == "error" and body["error"]["type"] == kind and needle in body["error"]["message"], body


# --------------------------------------------------------------------------- translation
def _translate(**body: Any) -> Any:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})
    return to_chat_request(request, "msg_x", {})


def test_system_blocks_turns_tool_use_and_results_become_chat_messages() -> None:
    chat = _translate(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "user", "content": [{"type": "text", "text": "And Bergen?"}]},  # (consecutive turns are one)
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it twice.", "signature": ""},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no such city"}], "is_error": True},
                {"type": "text", "text": "Thanks."}]},
        ],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"], temperature=0.5, top_k=3,
    )  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert messages[0]["content"] == "Be brief.\nUse tools." and messages[1]["content"] == "Weather in Oslo?\nAnd Bergen?"
    assistant = messages[2]
    assert (assistant["content"], assistant["reasoning_content"]) == ("Let me look.", "Call it twice.")
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [("toolu_1", {"city": "Oslo"}), ("toolu_2", {"city": "Bergen"})]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:5]] == [("toolu_1", "sunny"), ("toolu_2", "Error: no such city")]
    assert chat.tools[0].function.parameters == WEATHER["input_schema"] and chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.rid) == (8, ["END"], 0.5, 3, "msg_x")
    assert chat.continue_final_message is False
    named = _translate(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": "x"}])
    assert named.tool_choice.function.name == "get_weather" and named.parallel_tool_calls is True
    prefill = _translate(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}])
    assert prefill.continue_final_message is True


def _USE(fields: Dict[str, Any], result: Any = "sunny") -> List[Dict[str, Any]]:
    """A conversation whose assistant turn holds a tool_use block with `fields` added, answered with `result`."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}, **fields}
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]  # fmt: skip


def test_the_sdks_own_blocks_and_tool_options_it_honours_are_taken() -> None:
    """What the SDK's response blocks dump (caller and toolset_name null, a direct caller) and
    the tool options minisgl does (no eager streaming, direct callers, no deferred loading)."""
    blocks = _translate(messages=_USE({}, [{"type": "text", "text": "sunny,"}, {"type": "text", "text": "12 C", "citations": None}]))
    assert blocks.messages[2].content == "sunny,\n12 C"  # (a tool_result's text blocks joined as a message's)
    chat = _translate(messages=_USE({"caller": {"type": "direct"}, "toolset_name": None}),
                      tools=[{**WEATHER, "eager_input_streaming": False, "allowed_callers": ["direct"], "defer_loading": False, "input_examples": None}])  # fmt: skip
    assert chat.messages[1].tool_calls[0].function.name == "get_weather" and chat.tools[0].function.name == "get_weather"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "image blocks are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, "answers no tool_use"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                       {"role": "user", "content": "y"}]}, "tool_use ids were found without tool_result blocks immediately after: t"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "cannot be in a user message"),
        ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]}, "redacted_thinking"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305' tools are not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 'type must be "object"'),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "names its tool"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}, "cache_control.ttl"),
        ({"messages": _USE({"caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}})}, "messages[1].content[0].caller: calls made by 'code_execution_20250825'"),
        ({"messages": _USE({"toolset_name": "github"})}, "messages[1].content[0].toolset_name: toolsets are not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "eager_input_streaming": True}]}, "tools[0].eager_input_streaming: true is not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "allowed_callers": ["code_execution_20250825"]}]}, "tools[0].allowed_callers"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading: tool search"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "input_examples": [{"city": "Oslo"}]}]}, "tools[0].input_examples"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, {**WEATHER, "description": "again"}]}, "Tool names must be unique: 'get_weather'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]}, "messages[1].content is empty"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content is empty"),
        ({"messages": _USE({}, [{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}])}, "messages[2].content[0].content[0].citations: citations are not supported"),
        ({"messages": _USE({}, [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "xx"}}])},
         "messages[2].content[0].content[0]: image blocks are not supported"),
        ({"messages": _USE({}, [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}])}, "messages[2].content[0].content[0].cache_control.ttl"),
        ({"messages": _USE({}, [{"type": "tool_use", "id": "t", "name": "f", "input": {}}])}, "a tool_use block cannot be in a tool_result's content"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "a tool_result block cannot be in an assistant message"),
    ],
)
def test_what_cannot_be_translated_says_what_to_send(body: Dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        _translate(**body)


@pytest.mark.parametrize(
    "thinking, parser, read, expected",
    [
        ({"type": "disabled"}, "qwen3", frozenset({"enable_thinking"}), {"enable_thinking": False}),
        ({"type": "disabled"}, None, frozenset(), {}),  # (no parser: the server knows of no thinking to turn off)
        ({"type": "adaptive"}, "qwen3", frozenset({"enable_thinking"}), {"enable_thinking": True}),
        ({"type": "adaptive"}, "deepseek-r1", frozenset(), {}),
        ({"type": "enabled", "budget_tokens": 8}, "qwen3", frozenset(), {}),  # (the budget: thinking_budget's, below)
        ({"type": "disabled"}, "deepseek-r1", frozenset(), "cannot be honoured"),
        ({"type": "adaptive"}, None, frozenset(), "needs a server started with --reasoning-parser"),
        ({"type": "enabled", "budget_tokens": 4}, None, frozenset(), "needs a server started with --reasoning-parser"),
        ({"type": "enabled"}, "qwen3", frozenset(), "budget_tokens: Field required"),
        ({"type": "adaptive", "display": "omitted"}, "qwen3", frozenset(), "omitted"),
    ],
)
def test_thinking_maps_to_the_templates_switch_or_is_refused(thinking: Any, parser: Optional[str], read: Any, expected: Any) -> None:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": thinking})
    if isinstance(expected, dict):
        assert thinking_template_kwargs(request, parser, read) == expected
    else:
        with pytest.raises(BadMessagesRequest, match=expected):
            thinking_template_kwargs(request, parser, read)


# --------------------------------------------------------------------------- the message object
def test_a_message_has_the_sdks_shape(tiny_model: str, tmp_path: Any) -> None:
    out = _out("r", "Hello!", 4, STOP)
    out["meta_info"]["cached_tokens"] = 1
    client, seen = _client(tiny_model, tmp_path, [out])
    with client:
        r = _create(client, max_tokens=9, temperature=0.3, system="Be kind.")
    assert r.status_code == 200, r.text
    body = r.json()
    message = Message.model_validate(body)  # (the SDK's own type reads it)
    assert message.id.startswith("msg_") and seen[0].rid == message.id and seen[0].sampling_params["max_new_tokens"] == 9
    assert (message.type, message.role, message.model, message.stop_reason, message.stop_sequence) == ("message", "assistant", client.model, "end_turn", None)
    assert body["content"] == [{"type": "text", "text": "Hello!"}]
    assert body["usage"] == {"input_tokens": 2, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1}


@pytest.mark.parametrize(
    "finish, stop_sequences, reason, sequence",
    [(LENGTH, None, "max_tokens", None), ({"type": "stop", "matched": "END"}, ["END"], "stop_sequence", "END"), (STOP, ["END"], "end_turn", None)],
)
def test_stop_reasons(tiny_model: str, tmp_path: Any, finish: Any, stop_sequences: Any, reason: str, sequence: Optional[str]) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "Hel", 2, finish)])
    with client:
        body = _create(client, stop_sequences=stop_sequences).json()
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)


def test_thinking_and_a_forced_call_become_their_blocks(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 3, STOP)], reasoning_parser="qwen3")
    with client:
        body = _create(client, thinking={"type": "adaptive"}).json()
    assert body["content"] == [{"type": "thinking", "thinking": "The user greets me.", "signature": ""}, {"type": "text", "text": "Hello there!"}]
    client, seen = _client(tiny_model, tmp_path, [_out("r", FORCED, 9, STOP)])
    with client:
        body = _create(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).json()
    (call,) = Message.model_validate(body).content  # (a call and no text: no text block)
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Oslo"}) and call.id.startswith("toolu_")
    assert body["stop_reason"] == "tool_use" and "json_schema" in seen[0].sampling_params


def test_the_next_turn_takes_the_sdks_blocks_as_model_dump_gives_them(tiny_model: str, tmp_path: Any) -> None:
    """create -> [b.model_dump() for b in message.content] as the assistant turn -> the next create works."""
    answer = "<think>Check it.</think>Let me check.\n" + CALL
    client, seen = _client(tiny_model, tmp_path, [_out("r", answer, 9, STOP)], template=TOOLS_TEMPLATE, tool_call_parser="qwen25", reasoning_parser="qwen3")
    with client:
        first = Message.model_validate(_create(client, tools=[WEATHER], thinking={"type": "adaptive"}).json())
        assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[2].id, "content": "sunny"}]}]  # fmt: skip
        second = _create(client, tools=[WEATHER], thinking={"type": "adaptive"}, messages=messages)
    assert second.status_code == 200, second.text
    assert '<think>Check it.</think>Let me check.<call>get_weather {"city": "Oslo", "days": 3}</call>' in seen[1].text and "sunny" in seen[1].text


# --------------------------------------------------------------------------- streaming
def test_a_stream_sends_anthropics_events_in_order_and_they_add_up(tiny_model: str, tmp_path: Any) -> None:
    pieces = ["<think>\nThe user ", "greets me.\n</th", "ink>\n\nHello", " there!"]
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs, reasoning_parser="qwen3")
    with client:
        r = _create(client, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    kinds = [(name, d.get("index"), d.get("delta", {}).get("type")) for name, d in events]
    n_thinking = sum(1 for k in kinds if k[2] == "thinking_delta")
    n_text = sum(1 for k in kinds if k[2] == "text_delta")
    assert kinds == [("message_start", None, None),
                     ("content_block_start", 0, None), *[("content_block_delta", 0, "thinking_delta")] * n_thinking, ("content_block_stop", 0, None),
                     ("content_block_start", 1, None), *[("content_block_delta", 1, "text_delta")] * n_text, ("content_block_stop", 1, None),
                     ("message_delta", None, None), ("message_stop", None, None)]  # fmt: skip
    data = dict(events)
    start = data["message_start"]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 3
    assert [d["content_block"] for name, d in events if name == "content_block_start"] == [
        {"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]  # fmt: skip
    text = "".join(d["delta"]["text"] for _, d in events if d.get("delta", {}).get("type") == "text_delta")
    thinking = "".join(d["delta"]["thinking"] for _, d in events if d.get("delta", {}).get("type") == "thinking_delta")
    assert (thinking, text) == ("The user greets me.", "Hello there!")
    assert data["message_delta"]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None} and data["message_delta"]["usage"]["output_tokens"] == 4


def test_a_streamed_forced_call_sends_input_json_deltas(tiny_model: str, tmp_path: Any) -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": ', '"Oslo"}}]']
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        events = _events(_create(client, stream=True, tools=[WEATHER], tool_choice={"type": "any"}))
    start = events[1][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["id"].startswith("toolu_") and start["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for _, d in events if d.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(partial) == {"city": "Oslo"}
    assert [name for name, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_cut_streamed_call_is_not_followed_by_its_text_and_errors_end_a_stream(tiny_model: str, tmp_path: Any) -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Os']
    outs = [_out("r", pieces[0], 1), _out("r", pieces[1], 2, LENGTH)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        events = _events(_create(client, stream=True, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=2))
    assert [d["content_block"]["type"] for name, d in events if name == "content_block_start"] == ["tool_use"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    refused = {"type": "abort", "status_code": 503, "message": "The queue is full"}
    client, _ = _client(tiny_model, tmp_path, [_out("r", "", 0, refused)])
    with client:
        events = _events(_create(client, stream=True))
    assert events == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "The queue is full"}})]
    client, _ = _client(tiny_model, tmp_path, [_out("r", "Hel", 1), _out("r", "", 1, {"type": "abort"})])
    with client:
        events = _events(_create(client, stream=True))
    assert events[0][0] == "message_start" and events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


def _both(tiny_model: str, tmp_path: Any, answer: str, pieces: List[str], finish: Any, **body: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the non-streamed message of `answer`, the message the SDK's stream helper builds from the
    stream of `pieces`), with qwen25 calls under tool_choice auto; tool_use ids left out (fresh per answer)."""
    from anthropic.lib.streaming._messages import accumulate_event

    assert "".join(pieces) == answer
    args = dict(template=TOOLS_TEMPLATE, tool_call_parser="qwen25")
    whole, _ = _client(tiny_model, tmp_path, [_out("r", answer, 9, finish)], **args)
    outs = [_out("r", p, i + 1, finish if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    streamed, _ = _client(tiny_model, tmp_path, outs, **args)
    with whole:
        message = Message.model_validate(_create(whole, tools=[WEATHER], **body).json())
    with streamed:
        snapshot, buffers = None, {}  # type: ignore[var-annotated]
        for _, d in _events(_create(streamed, tools=[WEATHER], stream=True, **body)):
            snapshot = accumulate_event(event=EVENTS.validate_python(d), current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    return tuple(  # type: ignore[return-value]
        {"content": [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in m.content], "stop_reason": m.stop_reason}
        for m in (message, snapshot)
    )


def test_disable_parallel_tool_use_keeps_the_first_auto_call(tiny_model: str, tmp_path: Any) -> None:
    """tool_choice auto with disable_parallel_tool_use: two calls written, the first one answered, whole and streamed."""
    answer = "Two.\n" + CALL + "\n" + CALL.replace("Oslo", "Bergen")
    pieces = [answer[k : k + 11] for k in range(0, len(answer), 11)]
    whole, streamed = _both(tiny_model, tmp_path, answer, pieces, STOP, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    expected = [{"type": "text", "text": "Two."}, {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo", "days": 3}}]
    assert whole == streamed == {"content": expected, "stop_reason": "tool_use"}
    both, _ = _both(tiny_model, tmp_path, answer, [answer], STOP)
    assert [b.get("input") for b in both["content"]] == [None, {"city": "Oslo", "days": 3}, {"city": "Bergen", "days": 3}]


@pytest.mark.parametrize(
    "answer, cut, finish, expected",
    [
        # cut by max_tokens inside the call: a tool_use block of its partial input, both ways (Anthropic's)
        ("Sure. " + CALL, CALL.index("3}"), LENGTH, [{"type": "text", "text": "Sure."}, {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}}]),
        ("Sure. " + CALL, CALL.index("Oslo"), LENGTH, [{"type": "text", "text": "Sure."}, {"type": "tool_use", "name": "get_weather", "input": {}}]),
        (CALL + "\nmore text", None, LENGTH, [{"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo", "days": 3}}]),
        # text after the call: the parse refuses the call, so the answer is text (no tool_use block streams ahead of it)
        (CALL + "\nDone.", None, STOP, [{"type": "text", "text": CALL + "\nDone."}]),
        # arguments that are no object: no call (dropped, as an undefined function's), never a tool_use whose input is no object
        ("Hm. " + CALL.replace('{"city": "Oslo", "days": 3}', '"Oslo"'), None, STOP, [{"type": "text", "text": "Hm."}]),
        ("Hm. " + CALL.replace('{"city": "Oslo", "days": 3}', "[1]"), None, STOP, [{"type": "text", "text": "Hm."}]),
    ],
)
def test_the_stream_adds_up_to_the_non_streamed_message_around_calls(
    tiny_model: str, tmp_path: Any, answer: str, cut: Optional[int], finish: Any, expected: List[Dict[str, Any]]
) -> None:
    if cut is not None:
        answer = answer[: answer.index(CALL) + cut]
    pieces = [answer[k : k + 5] for k in range(0, len(answer), 5)]
    whole, streamed = _both(tiny_model, tmp_path, answer, pieces, finish)
    reason = "max_tokens" if finish is LENGTH else "end_turn"
    assert whole == streamed == {"content": expected, "stop_reason": reason}


# --------------------------------------------------------------------------- count_tokens
def test_count_tokens_counts_the_rendered_prompt(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [])
    tokenizer = get_tokenizer(tiny_model)
    with client:
        r = client.post("/v1/messages/count_tokens", json={"model": client.model, "system": "Be kind.", "messages": [{"role": "user", "content": "hi"}]})
        longer = client.post("/v1/messages/count_tokens", json={"model": client.model, "messages": [{"role": "user", "content": "hi there you"}]})
    assert r.status_code == 200 and MessageTokensCount.model_validate(r.json())
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert r.json() == {"input_tokens": len(tokenizer.encode(prompt, add_special_tokens=False))}
    assert longer.json()["input_tokens"] > 0


def test_a_thinking_budget_runs_sglangs_budget_processor_or_is_refused(tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """thinking enabled with budget_tokens N: the family's ThinkingBudgetLogitProcessor with
    custom_params {"thinking_budget": N} where the server runs processors and the vocabulary has
    the family's think ids; else a 400 on create and count_tokens alike, never a budget ignored."""
    from minisgl.sampling import custom_logit_processor as clp

    thinking = {"type": "enabled", "budget_tokens": 1024}
    count = {"messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    client, seen = _client(tiny_model, tmp_path, [], reasoning_parser="qwen3")
    with client:
        counted = client.post("/v1/messages/count_tokens", json={"model": client.model, **count})
        created = _create(client, max_tokens=2048, thinking=thinking)
    _assert_error(counted, 400, "invalid_request_error", "start the server with --enable-custom-logit-processor")
    assert counted.json() == created.json() and seen == []
    client, seen = _client(tiny_model, tmp_path, [], reasoning_parser="qwen3", enable_custom_logit_processor=True)
    with client:  # (the tiny vocabulary has no <think>: Qwen3's ids would force other tokens)
        _assert_error(_create(client, max_tokens=2048, thinking=thinking), 400, "invalid_request_error", "cannot be enforced on this model")

    tokenizer = get_tokenizer(tiny_model)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) + tokenizer.encode("\n", add_special_tokens=False)

    class TinyBudget(clp.ThinkingBudgetLogitProcessor):
        THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = ids

    monkeypatch.setitem(clp.THINKING_BUDGET_PROCESSORS, "qwen3", TinyBudget)
    outs = [_out("r", "<think>hm\n</think>\n\nHi.", 6, STOP)]
    client, seen = _scripted_client(tiny_model, tmp_path, outs, args={"reasoning_parser": "qwen3", "enable_custom_logit_processor": True}, tokenizer=tokenizer)
    with client:
        body = _create(client, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 8}).json()
        counted = client.post("/v1/messages/count_tokens", json={"model": client.model, **count})
    assert [b["type"] for b in body["content"]] == ["thinking", "text"] and counted.status_code == 200
    assert clp.CustomLogitProcessor.from_str(seen[0].custom_logit_processor).__class__.__name__ == "TinyBudget"
    assert seen[0].sampling_params["custom_params"] == {"thinking_budget": 8} and "thinking=True" in seen[0].text


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "body, needle",
    [
        ({"metadata": {"user_id": "u"}}, "metadata"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c"}, "container"),
        ({"output_config": {"effort": "low"}}, "output_config"),
        ({"context_management": {"edits": []}}, "context_management"),
        ({"whatever": 1}, "whatever"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"cache_control": {"type": "ephemeral", "ttl": "5m"}}, "cache_control.ttl"),
        ({"thinking": {"type": "adaptive"}}, "--reasoning-parser"),
        ({"tools": [WEATHER]}, "--tool-call-parser"),  # (tool_choice auto, the default, said in Anthropic's words)
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "Tool 'nope' not found"),
    ],
)
def test_what_is_not_built_is_a_400_in_anthropics_shape(tiny_model: str, tmp_path: Any, body: Dict[str, Any], needle: str) -> None:
    client, seen = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)])
    with client:
        r = _create(client, **body)
    _assert_error(r, 400, "invalid_request_error", needle)
    assert seen == []  # (nothing reached the scheduler)
    if "tools" in body and "tool_choice" not in body:
        assert '{"type": "any"}' in r.json()["error"]["message"] and '"required"' not in r.json()["error"]["message"]


def test_unknown_model_missing_max_tokens_and_a_non_json_body(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [])
    with client:
        _assert_error(_create(client, model="nope"), 404, "not_found_error", "nope")
        _assert_error(client.post("/v1/messages", json={"model": client.model, "messages": [{"role": "user", "content": "x"}]}), 400,
                      "invalid_request_error", "max_tokens")  # fmt: skip
        _assert_error(client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"}), 400, "invalid_request_error", "JSON")
        assert client.post("/v1/chat/completions", json={"model": client.model}).json()["error"]["type"] == "BadRequestError"  # (chat's shape kept)


def test_an_api_key_is_taken_as_x_api_key_or_bearer_on_these_routes_only(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", "x", 1, STOP)], api_key="sekret")
    with client:
        _assert_error(_create(client), 401, "authentication_error", "API key")
        _assert_error(_create(client, headers={"x-api-key": "wrong"}), 401, "authentication_error", "API key")
        assert _create(client, headers={"x-api-key": "sekret"}).status_code == 200
        assert _create(client, headers={"authorization": "Bearer sekret"}).status_code == 200
        chat = client.post("/v1/chat/completions", json={"model": client.model, "messages": [{"role": "user", "content": "x"}]}, headers={"x-api-key": "sekret"})
        assert chat.status_code == 401 and chat.json()["error"]["type"] == "AuthenticationError"


def test_error_types_are_the_sdks() -> None:
    """Every status maps to a type of the SDK's ErrorType (a 413 too: invalid_request_error, as no
    `request_too_large` type exists there)."""
    from typing import get_args

    from anthropic.types.shared.error_type import ErrorType

    from minisgl.entrypoints.anthropic.serving import anthropic_error_body

    assert all(anthropic_error_body("x", status)["error"]["type"] in get_args(ErrorType) for status in range(400, 600))
    assert [anthropic_error_body("x", s)["error"]["type"] for s in (401, 404, 413, 503, 500)] == [
        "authentication_error", "not_found_error", "invalid_request_error", "overloaded_error", "api_error"]  # fmt: skip
