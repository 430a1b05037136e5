"""End-to-end: the Responses API of a real `python -m minisgl serve`, driven by the official openai SDK
(`client.responses`). One server for the module (test_server_e2e's Server), with a chat template that
renders an assistant's tool calls, so that a function call's result can come back."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from test_server_e2e import TOOL_CALLS_TEMPLATE, Server, wait_until_freed


pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The quick brown fox"
# (an enum: a random model's free string could run past any token budget)
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("srv")
    template = folder / "calls.jinja"
    template.write_text(TOOL_CALLS_TEMPLATE)
    # (compact JSON: a grammar's answers are short whatever the random weights like)
    s = Server(tiny_model, str(folder / "server.log"), "--chat-template", str(template), "--constrained-json-disable-any-whitespace")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def test_a_response_says_what_chat_says_for_the_same_greedy_prompt(server: Server, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    r = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_the_sdks_stream_yields_the_events_in_order_and_they_add_up(server: Server, client: openai.OpenAI) -> None:
    whole = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=server.model, input=PROMPT, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.status == whole.status


def test_max_output_tokens_makes_an_incomplete_response(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 2


def test_a_json_schema_text_format_yields_json_of_that_schema(server: Server, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(model=server.model, input="A colour:", max_output_tokens=48, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})  # fmt: skip
    assert r.status == "completed" and json.loads(r.output_text)["colour"] in ("red", "green")


def test_a_forced_call_then_its_result_through_previous_response_id(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model=server.model, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=128,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    second = client.responses.create(model=server.model, previous_response_id=first.id, max_output_tokens=4, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])  # fmt: skip
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the earlier turn counts: the prompt holds the question, the call and its answer
    assert second.usage.input_tokens > first.usage.input_tokens
    (item,) = client.responses.input_items.list(second.id).data
    assert item.type == "function_call_output" and item.call_id == call.call_id


def test_stored_responses_are_retrieved_listed_and_deleted(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(model=server.model, input=[{"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}],
                                max_output_tokens=3, temperature=0, metadata={"run": "e2e"})  # fmt: skip
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.metadata == {"run": "e2e"}
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc").data] == ["Hi", "there"]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model, input="x", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(client.responses.create(model=server.model, input="x", max_output_tokens=1).id)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]}]}, "input"),
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_what_is_not_built_is_a_bad_request_error(server: Server, client: openai.OpenAI, kwargs: Any, param: str) -> None:
    body = {"model": server.model, "input": "x", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.param == param


def test_a_client_that_hangs_up_aborts_its_response(server: Server) -> None:
    body = {"model": server.model, "input": PROMPT, "max_output_tokens": 1500, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and "output_text.delta" in line:
                break  # got a token: hang up mid-stream
    load = wait_until_freed(server)
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0
