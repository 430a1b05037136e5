"""End-to-end: the Anthropic Messages API of a real `python -m minisgl serve`, driven by the official
`anthropic` SDK (`client.messages`). One server for the module (test_server_e2e's Server), with
--api-key and a chat template that renders an assistant's tool calls, so that a tool's result can
come back."""

from __future__ import annotations

from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from test_server_e2e import TOOL_CALLS_TEMPLATE, Server, wait_until_freed


pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sekret"
PROMPT = "The quick brown fox"
# (an enum: a random model's free string could run past any token budget)
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("srv")
    template = folder / "calls.jinja"
    template.write_text(TOOL_CALLS_TEMPLATE)
    s = Server(tiny_model, str(folder / "server.log"), "--chat-template", str(template), "--constrained-json-disable-any-whitespace", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_a_message_says_what_chat_says_for_the_same_greedy_prompt(server: Server, client: anthropic.Anthropic) -> None:
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=server.model, messages=_user(PROMPT), max_tokens=8, temperature=0)
    m = client.messages.create(model=server.model, messages=_user(PROMPT), max_tokens=8, extra_body={"temperature": 0})
    assert m.id.startswith("msg_") and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens and m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")


def test_the_sdks_stream_helper_adds_up_to_the_message(server: Server, client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=server.model, messages=_user(PROMPT), max_tokens=8, extra_body={"temperature": 0})
    with client.messages.stream(model=server.model, messages=_user(PROMPT), max_tokens=8, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert deltas == final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_max_tokens_and_a_stop_sequence(server: Server, client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=server.model, messages=_user(PROMPT), max_tokens=2, extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    longer = client.messages.create(model=server.model, messages=_user(PROMPT), max_tokens=12, extra_body={"temperature": 0}).content[0].text
    stop = longer.strip()[len(longer.strip()) // 2 :][:3]  # (a piece of the greedy answer's second half)
    assert stop
    cut = client.messages.create(model=server.model, messages=_user(PROMPT), max_tokens=12, stop_sequences=[stop], extra_body={"temperature": 0})
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert stop not in cut.content[0].text and longer.startswith(cut.content[0].text)
    # max_tokens 0: Anthropic's cache warm-up, a prefill alone; the same prompt is then a radix hit
    warm = client.messages.create(model=server.model, messages=_user("Warm this prompt up, please."), max_tokens=0)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0) and warm.usage.input_tokens > 0
    hit = client.messages.create(model=server.model, messages=_user("Warm this prompt up, please."), max_tokens=1)
    assert hit.usage.cache_read_input_tokens > 0


def test_a_forced_tool_use_then_its_result(server: Server, client: anthropic.Anthropic) -> None:
    first = client.messages.create(model=server.model, messages=_user("Weather in Oslo?"), max_tokens=128, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})  # fmt: skip
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo")
    messages = _user("Weather in Oslo?") + [first.to_param(), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    second = client.messages.create(model=server.model, messages=messages, max_tokens=4, tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body={"temperature": 0})  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens")
    # the earlier turn counts: the prompt holds the question, the call and its result
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_count_tokens_is_the_prompt_a_create_reads(server: Server, client: anthropic.Anthropic) -> None:
    body = {"model": server.model, "system": "Count me.", "messages": _user("A prompt never sent before, 1729.")}
    counted = client.messages.count_tokens(**body)
    m = client.messages.create(max_tokens=1, **body)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens and m.usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"metadata": {"user_id": "u"}}, "metadata"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}, "image"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "reasoning-parser"),
    ],
)
def test_what_is_not_built_is_a_bad_request_error(server: Server, client: anthropic.Anthropic, kwargs: dict, needle: str) -> None:
    body = {"model": server.model, "messages": _user("x"), "max_tokens": 4, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**body)
    assert e.value.body["error"]["type"] == "invalid_request_error" and needle in e.value.body["error"]["message"]


def test_the_key_goes_as_x_api_key_or_bearer(server: Server) -> None:
    with anthropic.Anthropic(base_url=server.url, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0) as by_header:
        assert by_header.messages.create(model=server.model, messages=_user("x"), max_tokens=1).usage.output_tokens == 1
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=server.model, messages=_user("x"), max_tokens=1)


def test_a_client_that_hangs_up_aborts_its_message(server: Server) -> None:
    body = {"model": server.model, "messages": _user(PROMPT), "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and "text_delta" in line:
                break  # got a token: hang up mid-stream
    load = wait_until_freed(server, headers={"authorization": f"Bearer {KEY}"})
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0
