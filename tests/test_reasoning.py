"""--reasoning-parser: a thinking model's <think>...</think> as reasoning_content, apart from the answer."""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Tuple

import pytest

from test_openai_fields import _events
from test_openai_protocol import _out, _scripted_client

from minisgl.entrypoints.openai.reasoning import ReasoningSplitter, split_reasoning

STOP = {"type": "stop", "matched": 2}
THOUGHT = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("qwen3", THOUGHT, ("The user greets me.\nI greet back.", "Hello there!")),
        ("qwen3", "Hello there!", ("", "Hello there!")),  # (enable_thinking false: no tags at all)
        ("qwen3", "  <think>cut off before the end", ("cut off before the end", "")),
        ("qwen3", "<think></think>\n\nJust the answer.", ("", "Just the answer.")),
        ("qwen3", "A <think> later is text", ("", "A <think> later is text")),
        # the template opened the reasoning: the output starts inside it
        ("deepseek-r1", "Let me see.\n</think>\n\n42", ("Let me see.", "42")),
        ("deepseek-r1", "<think>Let me see.</think>42", ("Let me see.", "42")),
        ("deepseek-r1", "thinking, and cut off", ("thinking, and cut off", "")),
    ],
)
def test_a_whole_answer_splits_into_reasoning_and_content(parser: str, text: str, expected: Tuple[str, str]) -> None:
    assert split_reasoning(parser, text) == expected


def _streamed(parser: str, pieces: List[str]) -> Tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_a_stream_cut_anywhere_adds_up_to_the_whole_answer(parser: str) -> None:
    """Pieces of one or more characters, cut inside the tags and inside the blanks around them."""
    rng = random.Random(0)
    texts = [THOUGHT, "<think> a </think>", "x</think>", " \n <think>\n\n</think>\n \nend \n", "<thi", "</think", "plain text"]
    for text in texts:
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1)))) if len(text) > 1 else []
            pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
            assert _streamed(parser, pieces) == split_reasoning(parser, text), (text, pieces)


def _client(tiny_model: str, tmp_path: Any, outs: List[Dict[str, Any]], parser: Optional[str] = "qwen3", tools: Optional[str] = None) -> Any:
    from minisgl.server_args import ServerArgs, resolve_server_args

    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", reasoning_parser=parser, tool_call_parser=tools))
    return _scripted_client(tiny_model, tmp_path, outs, server_args=args)


def _chat(client: Any, **body: Any) -> Any:
    payload = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], **body}
    return client.post("/v1/chat/completions", json=payload)


def test_the_thinking_comes_back_as_reasoning_content(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 12, STOP)])
    with client:
        message = _chat(client).json()["choices"][0]["message"]
        kept = _chat(client, separate_reasoning=False).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets me.\nI greet back.", "Hello there!")
    assert (kept["reasoning_content"], kept["content"]) == (None, THOUGHT)  # (SGLang's separate_reasoning: false)
    client, _ = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 12, STOP)], parser=None)
    with client:
        message = _chat(client).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, THOUGHT)  # no parser: the text as it is


def test_a_stream_sends_reasoning_deltas_then_content_deltas(tiny_model: str, tmp_path: Any) -> None:
    pieces = ["<think>\nThe user ", "greets me.\nI greet back.\n</th", "ink>\n\nHello", " there!"]
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        chunks = [e for e in _events(_chat(client, stream=True)) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(reasoning) == "The user greets me.\nI greet back." and "".join(content) == "Hello there!"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning first, then the answer
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_are_parsed_from_the_answer_after_the_thinking(tiny_model: str, tmp_path: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    client, _ = _client(tiny_model, tmp_path, [_out("r", "<think>Weather: ask the tool.</think>\n" + call, 30, STOP)], tools="qwen25")
    with client:
        choice = _chat(client, tools=tools).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Weather: ask the tool."
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_parser_is_a_server_option_and_checked() -> None:
    from minisgl import Engine
    from minisgl.server_args import ServerArgs

    with pytest.raises(ValueError, match="--reasoning-parser must be one of qwen3, deepseek-r1, got 'r1'"):
        ServerArgs(reasoning_parser="r1")
    with pytest.raises(ValueError, match="reasoning_parser: option"):  # (the Engine has no chat route to parse for)
        Engine(device="cpu", reasoning_parser="qwen3")


def test_the_answer_goes_back_into_the_next_turn_as_the_sdk_returns_it(tiny_model: str, tmp_path: Any) -> None:
    """`messages.append(choice.message.model_dump())`: its reasoning_content (null without a
    parser) goes to the template, which decides what to show (Qwen3's shows the latest turn's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }};{% endfor %}"
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "assistant", "content": "More?", "reasoning_content": None}, {"role": "user", "content": "bye"}]  # fmt: skip
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, STOP)], tokenizer=tokenizer)
    with client:
        assert _chat(client, messages=turn).status_code == 200
        r = _chat(client, messages=[{"role": "user", "content": "hi", "reasoning_content": "no"}])
    assert seen[0].text == "user:|hi;assistant:Greet back.|Hello!;assistant:|More?;user:|bye;"
    assert r.status_code == 400 and "only assistant messages carry reasoning_content" in r.text


def test_a_thinking_request_asks_for_its_grammar_after_the_thinking(tiny_model: str, tmp_path: Any) -> None:
    """A forced call or a json_schema held from the first token: a thinking model could never write
    </think>, and deepseek-r1's parser put the whole constrained answer in reasoning_content."""
    call = '[{"name": "get_weather", "parameters": {}}]'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    client, seen = _client(tiny_model, tmp_path, [_out("r", "Weather: a call.</think>" + call, 20, STOP)], parser="deepseek-r1")
    with client:
        choice = _chat(client, tools=tools, tool_choice="required").json()["choices"][0]
    assert seen[0].require_reasoning and "json_schema" in seen[0].sampling_params
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Weather: a call."
    from transformers import AutoTokenizer

    from minisgl.server_args import ServerArgs, resolve_server_args

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)  # (a template that reads enable_thinking, as Qwen3's)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %}/no_think{% endif %}"
    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", reasoning_parser="qwen3"))
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "{}", 2, STOP)], server_args=args, tokenizer=tokenizer)
    with client:
        _chat(client, response_format={"type": "json_object"})
        _chat(client, response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    assert [obj.require_reasoning for obj in seen] == [True, False]  # (no thinking: the grammar holds from the start)


@pytest.mark.parametrize("stream", [True, False])
def test_continuing_an_assistant_message_that_opened_its_thinking_stays_in_the_reasoning(tiny_model: str, tmp_path: Any, stream: bool) -> None:
    """continue_final_message after "<think>Let me": the output starts inside the reasoning (the
    tag was the user's text), so its "</think>" ends it; it came back as content, tag and all."""
    outs = [_out("r", " see.</think>\n\nDone.", 6, STOP)]
    client, _ = _client(tiny_model, tmp_path, outs)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>Let me"}]
    with client:
        r = _chat(client, messages=messages, continue_final_message=True, stream=stream)
    if stream:
        deltas = [e["choices"][0]["delta"] for e in _events(r) if e != "[DONE]" and e["choices"]]
        got = ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas))
    else:
        message = r.json()["choices"][0]["message"]
        got = (message["reasoning_content"], message["content"])
    assert got == (" see.", "Done.")
    assert split_reasoning("qwen3", "more", continues="<think>a</think>") == ("", "more")  # (its thinking was over)


def test_continuing_after_the_thinking_holds_the_grammar_from_the_first_token(tiny_model: str, tmp_path: Any) -> None:
    """An assistant text whose thinking ended: the model will not write another </think>, so a
    grammar waiting for one never started and the output was free."""
    client, seen = _client(tiny_model, tmp_path, [_out("r", "{}", 2, STOP)])
    done = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>done</think>\n\n"}]
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>still"}]
    with client:
        for messages in (done, opened):
            _chat(client, messages=messages, continue_final_message=True, response_format={"type": "json_object"})
    assert [obj.require_reasoning for obj in seen] == [False, True]


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece_when_the_thinking_ends(tiny_model: str, tmp_path: Any) -> None:
    # (a blank-only piece: the splitter holds its text, and its token must not overtake the reasoning's)
    pieces = ["<think>\nThe user ", "greets me.", "\n", "I greet", " back.\n</th", "ink>\n\nHello", " there!"]
    outs = [_out("r", p, i + 1, STOP if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    for i, out in enumerate(outs):  # one token per piece, with its logprob
        out["meta_info"]["output_token_logprobs"] = [(-0.5 - i, 10 + i, None)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        held_chunks = [c for c in _events(_chat(client, stream=True, stream_reasoning=False, logprobs=True)) if c != "[DONE]"]
        chunks = [c for c in _events(_chat(client, stream=True, logprobs=True)) if c != "[DONE]"]
    held = [c["choices"][0]["delta"] for c in held_chunks]
    reasoning = [d["reasoning_content"] for d in held if "reasoning_content" in d]
    assert reasoning == ["The user greets me.\nI greet back."]  # one delta, not one per piece
    first = next(i for i, d in enumerate(held) if "reasoning_content" in d)
    assert not any(d.get("content") for d in held[:first])  # (the answer comes after it)
    assert "".join(d.get("content") or "" for d in held) == "Hello there!"
    streamed = [c["choices"][0]["delta"]["reasoning_content"] for c in chunks if "reasoning_content" in c["choices"][0]["delta"]]
    assert len(streamed) > 1 and "".join(streamed) == reasoning[0]  # (the default streams it as it comes)

    def logprobs(stream: List[Dict[str, Any]]) -> List[float]:
        return [t["logprob"] for c in stream if c["choices"][0].get("logprobs") for t in c["choices"][0]["logprobs"]["content"]]

    # held back with the reasoning, every token's logprob still comes once, in order
    assert logprobs(held_chunks) == logprobs(chunks) == [-0.5 - i for i in range(len(pieces))]


def test_stream_reasoning_false_holds_a_reasoning_cut_off_until_the_end(tiny_model: str, tmp_path: Any) -> None:
    pieces = ["<think>Still ", "thinking", " when cut"]
    outs = [_out("r", p, i + 1, {"type": "length", "length": 3} if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    client, _ = _client(tiny_model, tmp_path, outs)
    with client:
        deltas = [c["choices"][0]["delta"] for c in _events(_chat(client, stream=True, stream_reasoning=False)) if c != "[DONE]"]
    assert [d["reasoning_content"] for d in deltas if "reasoning_content" in d] == ["Still thinking when cut"]


def test_stream_reasoning_false_without_a_reasoning_parser_is_refused(tiny_model: str, tmp_path: Any) -> None:
    client, _ = _client(tiny_model, tmp_path, [_out("r", THOUGHT, 12, STOP)] * 3, parser=None)
    with client:
        r = _chat(client, stream_reasoning=False, stream=True)
        assert r.status_code == 400 and "stream_reasoning: false needs a server started with --reasoning-parser" in r.text
        # (what asks for nothing the server lacks is fine: the defaults sent explicitly, and separate_reasoning false)
        assert _chat(client, separate_reasoning=False).status_code == 200
        assert _chat(client, separate_reasoning=True).status_code == 200
        assert _chat(client, stream_reasoning=True).status_code == 200


def test_reasoning_effort_is_a_chat_template_variable(tiny_model: str, tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }};{% endfor %}effort={{ reasoning_effort or 'unset' }}"
    client, seen = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, STOP)] * 2, tokenizer=tokenizer)
    with client:
        assert _chat(client, reasoning_effort="low").status_code == 200
        assert _chat(client).status_code == 200
        twice = _chat(client, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
        bad = _chat(client, reasoning_effort="extreme")
    assert [s.text for s in seen] == ["hi;effort=low", "hi;effort=unset"]
    assert twice.status_code == 400 and "reasoning_effort is given twice" in twice.text
    assert bad.status_code == 400 and "reasoning_effort" in bad.text
    client, _ = _scripted_client(tiny_model, tmp_path, [_out("r", "ok", 1, STOP)])  # (a template that never reads it)
    with client:
        r = _chat(client, reasoning_effort="high")
    assert r.status_code == 400 and "reasoning_effort is not used by this model's chat template" in r.text
