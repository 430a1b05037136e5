"""Tool calls as they stream (entrypoints/openai/tool_call_stream.py): a call's id and name once
its name is read and offered, then its arguments in pieces that add up, byte for byte, to the
non-streaming answer's `arguments` (json.dumps of the parsed value), whatever the chunking.

Each answer is fed to the streamer in every split worth trying (a character at a time, random
token-like chunks, whole); at every step the deltas so far must be OpenAI's shape, their
arguments a prefix of the final ones, and a call's header must come only after its name is
complete. The chat route, scripted, checks the same through HTTP with n > 1.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from test_openai_fields import _events
from test_openai_protocol import _out
from test_tool_parsers import EXAMPLES, STOP, TIME, TOOLS, WEATHER, _chat, _client, _coder, streamed_calls, tool_deltas

from minisgl.entrypoints.openai.protocol import ToolCall
from minisgl.entrypoints.openai.tool_calls import StreamedText, forced_call_stream, parse_tool_calls
from minisgl.entrypoints.openai.tool_parsers import TOOL_CALL_FORMATS

# arguments as a model may write them: blanks anywhere, escapes json.dumps writes otherwise
# (\u00fc is "ü", \/ is "/", a surrogate pair one character, a lone one stays), nesting, numbers
# json.loads->json.dumps rewrites (1e5 -> 100000.0, -0 -> 0, 1.50 -> 1.5), escaped quotes
ARGUMENTS = [
    '{"city": "Z\\u00fcrich"}',
    '{ "city" :"Oslo" ,"days":3 }',
    '{"q": "say \\"hi\\" \\\\ back\\/slash\\n\\ttab \\ud83d\\ude00 \\ud83d lone \\u0007"}',
    '{"n": [1e5, -0.0, 10, -0, 1.50, 2E-3, true, false, null, {"deep": [[], {}, [{"x": "y"}]]}], "m": {}}',
    '{\n  "nested": {"a": {"b": ["c", {"d": -12.5e+2}]}},\n  "empty": ""\n}',
    '{"ascii": "\\u0041\\u00e9\\u4e2d", "emoji": "😀 ü", "ctrl": "\\u001f"}',
    "{}",
    '{"x": NaN, "y": -Infinity}',  # (json.loads takes them; json.dumps writes them back)
]
_FORMAT_CALL = {  # a whole answer holding one call of get_weather with arguments @A@, per format
    "qwen25": 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": @A@}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": @A@}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": @A@, "id": "a1b2c3d4e"}]',
}
_FORMAT_TWO = {  # two calls, the second after the first (and, in mistral, a compact one)
    "qwen25": '<tool_call>\n{"arguments": @A@, "name": "get_weather"}\n</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": @A@}; {"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]@A@[TOOL_CALLS]get_time[ARGS]{}',
}


def _chunkings(text: str, seed: int = 0) -> List[List[str]]:
    """The splits a stream may bring: one character at a time, random token-like chunks, whole."""
    rng = random.Random(seed)
    splits = [list(text), [text]]
    for k in (2, 3, 5, 9):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(k, len(text) - 1)))
        splits.append([text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])])
    return splits


Feeder = Tuple[Callable[[str], List[Any]], Callable[[], List[Any]]]


def _auto(parser: str) -> Callable[[str], Feeder]:
    def make(answer: str) -> Feeder:
        splitter = StreamedText(TOOLS, TOOL_CALL_FORMATS[parser])

        def feed(piece: str) -> List[Any]:
            splitter.feed(piece)
            return splitter.tool_deltas()

        def finish() -> List[Any]:
            return splitter.finish_deltas(splitter.finish()[1])

        return feed, finish

    return make


def _forced(answer: str) -> Feeder:
    stream = forced_call_stream()
    return stream.feed, lambda: stream.finish(parse_tool_calls(answer))


def _final(parser: str, answer: str) -> Optional[List[ToolCall]]:
    return parse_tool_calls(answer) if parser == "forced" else TOOL_CALL_FORMATS[parser].parse(answer, TOOLS)[1]


def _stream(parser: str, pieces: List[str]) -> Tuple[List[Dict[str, Any]], List[Tuple[str, List[Dict[str, Any]]]]]:
    """(all the deltas, as JSON, and per piece: the text fed so far and the deltas so far)."""
    answer = "".join(pieces)
    feed, finish = _forced(answer) if parser == "forced" else _auto(parser)(answer)
    deltas: List[Dict[str, Any]] = []
    steps, fed = [], ""
    for piece in pieces:
        fed += piece
        deltas += [d.model_dump() for d in feed(piece)]
        steps.append((fed, list(deltas)))
    deltas += [d.model_dump() for d in finish()]
    return deltas, steps


def _check_stream(parser: str, answer: str) -> None:
    """Every split: (1) each call opens with its id and name and arguments "" (streamed_calls
    checks the shape); (2) the pieces add up to the whole answer's arguments; (3) at every step,
    what went out is a prefix of the final calls, and a header only once its name is complete."""
    final = _final(parser, answer)
    assert final, answer
    want = [(c.function.name, c.function.arguments) for c in final]
    for pieces in _chunkings(answer):
        deltas, steps = _stream(parser, pieces)
        assert [(c["name"], c["arguments"]) for c in streamed_calls(deltas)] == want, pieces
        for fed, so_far in steps:
            for call, (name, arguments) in zip(streamed_calls(so_far), want):
                assert call["name"] == name and arguments.startswith(call["arguments"]), (fed, call)
                assert any(f in fed for f in (f'"{name}"', f"{name}[ARGS]", f"{name}(", f"<function={name}>")), fed
        if pieces == list(answer):  # (a character at a time: the calls went out before the answer's end)
            assert len(streamed_calls(steps[-2][1])) == len(want)


@pytest.mark.parametrize("parser", list(_FORMAT_CALL))
@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_a_calls_arguments_stream_as_the_whole_answer_writes_them(parser: str, arguments: str) -> None:
    _check_stream(parser, _FORMAT_CALL[parser].replace("@A@", arguments))
    _check_stream(parser, _FORMAT_TWO[parser].replace("@A@", arguments))


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_a_forced_calls_arguments_stream_as_the_whole_answer_writes_them(arguments: str) -> None:
    _check_stream("forced", f'[{{"name": "get_weather", "parameters": {arguments}}}]')
    _check_stream("forced", f' [ {{"parameters": {arguments},"name":"get_weather"}} , {{"name": "get_time", "parameters": {{}}}}]\n')


def test_pythonic_calls_go_out_whole_when_their_parenthesis_closes() -> None:
    answer = 'Checking. [get_weather(city="a)b\\"c", days=(1, 2), opts={"u": [1.5]}), get_time()]'
    _check_stream("pythonic", answer)
    feed, _ = _auto("pythonic")(answer)
    assert feed(answer[: answer.index("days")]) == []  # (a `)` inside a string closes nothing)
    header, piece = [d.model_dump() for d in feed(answer[answer.index("days") : answer.index(", get_time")])]
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert piece == {"index": 0, "function": {"arguments": '{"city": "a)b\\"c", "days": [1, 2], "opts": {"u": [1.5]}}'}}


def test_numbers_and_names_wait_until_they_cannot_change() -> None:
    """A number goes out only once the character after it ends it (`1` may be `1e5`), and its
    json.dumps form; a call only once its name's closing quote is read ("get_weather" may be
    "get_weather_v2")."""
    feed, finish = _auto("qwen25")('<tool_call>{"name": "get_weather", "arguments": {"n": 1e5, "s": "x"}}</tool_call>')
    assert feed('<tool_call>{"name": "get_weather') == []
    (header,) = feed('"')
    assert header.function.name == "get_weather" and header.function.arguments == "" and header.id
    assert [d.function.arguments for d in feed(', "arguments": {"n": 1')] == ['{"n": ']
    assert [d.function.arguments for d in feed("e5")] == []
    assert [d.function.arguments for d in feed(', "s": "x')] == ['100000.0, "s": "x']
    assert [d.function.arguments for d in feed('"}}</tool_call>') + finish()] == ['"}']


@pytest.mark.parametrize("answer", [a for a, _, calls in EXAMPLES["qwen3_coder"] if calls])
def test_qwen3_coder_calls_stream_as_the_whole_answer_writes_them(answer: str) -> None:
    """Every answer of tests/test_tool_parsers.py's table that holds calls (each schema type,
    values that fail their type, markup inside a value, a missing last </tool_call>)."""
    _check_stream("qwen3_coder", answer)


def test_qwen3_coder_sends_a_call_at_its_name_and_each_parameter_at_its_close() -> None:
    answer = _coder("record", ("count", "12"), ("note", "two\nlines"))
    feed, finish = _auto("qwen3_coder")(answer)
    assert feed(answer[: answer.index("record") + len("record")]) == []  # ("record" may still be "record_v2")
    (header,) = feed(">")
    assert header.function.name == "record" and header.function.arguments == "" and header.id
    rest = answer[answer.index("record>") + len("record>") :]
    at = rest.index("</parameter>") + len("</parameter>")
    assert feed(rest[: at - 1]) == []  # (a value is known only at its close: "12" may be "123")
    assert [d.function.arguments for d in feed(rest[at - 1 : at])] == ['{"count": 12']
    end = rest.index("</function>")
    assert [d.function.arguments for d in feed(rest[at:end])] == [', "note": "two\\nlines"']
    assert [d.function.arguments for d in feed(rest[end:]) + finish()] == ["}"]


def test_a_repeated_qwen3_coder_parameter_keeps_its_first_value_streamed_or_not(caplog: pytest.LogCaptureFixture) -> None:
    """The first value went out before the repeat was read: the answer keeps it too, so the
    streamed arguments are the answer's, valid JSON, with nothing to settle."""
    answer = _coder("get_weather", ("city", "Oslo"), ("days", "2"), ("city", "Paris"))
    assert _final("qwen3_coder", answer)[0].function.arguments == '{"city": "Oslo", "days": "2"}'
    for pieces in _chunkings(answer):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minisgl.tool_calls"):
            deltas, _ = _stream("qwen3_coder", pieces)
        (call,) = streamed_calls(deltas)
        assert json.loads(call["arguments"]) == {"city": "Oslo", "days": "2"} and not caplog.text, pieces


@pytest.mark.parametrize(
    "answer, arguments",
    [  # (Qwen3-Coder drops a </parameter> at times: the next tag on a line of its own ends the value)
        ("<tool_call>\n<function=record>\n<parameter=note>\nParis\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
         {"note": "Paris", "count": 3}),
        ("<tool_call>\n<function=record>\n<parameter=note>\nParis\n</parameter>\n<parameter=count>\n3\n</function>\n</tool_call>",
         {"note": "Paris", "count": 3}),
        ("<tool_call>\n<function=record>\n<parameter=note>\na </function>\n\n<parameter=count>\n3\n</function>", {"note": "a </function>\n", "count": 3}),
    ],
)
def test_a_qwen3_coder_value_without_its_close_ends_at_the_next_tag_at_every_cut(answer: str, arguments: Dict[str, Any]) -> None:
    """Whole and streamed, cut at every place and a character at a time, the same arguments."""
    (whole,) = _final("qwen3_coder", answer)
    assert json.loads(whole.function.arguments) == arguments
    for pieces in [list(answer)] + [[answer[:i], answer[i:]] for i in range(1, len(answer))]:
        deltas, _ = _stream("qwen3_coder", pieces)
        assert [(c["name"], c["arguments"]) for c in streamed_calls(deltas)] == [("record", whole.function.arguments)], pieces


@pytest.mark.parametrize(
    "parser, answer",
    [
        ("qwen3_coder", "See <tools> and <tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=get_weather_v2>\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>"),
        ("qwen25", "Text <tools> and <tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {\"path\": \"/\"}}\n</tool_call>"),
        ("qwen25", '<tool_call>\n{"name": "get_weather_v2", "arguments": {}}\n</tool_call>'),
        ("llama3", '{"name": "Ada", "age": 36}'),
        ("llama3", '{"name": "get_weather", "city": "Oslo"}'),  # (untagged, no arguments named: JSON, not a call)
        ("llama3", 'Here: {"name": "get_time", "age": 1}'),
        ("mistral", "See [TOOL_] and [1]."),
        ("mistral", '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]'),
        ("mistral", "[TOOL_CALLS]get_time{}"),
        ("pythonic", "See [get_weather] and [get_time]."),
        ("pythonic", "[get_weather('Paris')]"),
        ("pythonic", "[rm_rf(path='/')]"),
    ],
)
def test_text_that_only_looks_like_a_call_sends_no_tool_delta(parser: str, answer: str) -> None:
    for pieces in _chunkings(answer):
        deltas, _ = _stream(parser, pieces)
        assert deltas == [], pieces


def test_a_repeated_key_is_settled_at_the_end_where_it_can_be(caplog: pytest.LogCaptureFixture) -> None:
    """json.loads keeps a repeated key's last value at the first one's place: the stream stops
    writing that call at the repeat. At the end the rest is sent if what went out is a prefix of
    the answer's arguments; if not (the one case a stream's arguments differ) it is logged, and
    the call's arguments stay what went out before the repeat."""
    _check_stream("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"a": 1, "a": 1}}\n</tool_call>')
    _check_stream("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"a": {"b": 1, "b": 1}}}\n</tool_call>')
    unsettled = [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"a": 1, "b": 2, "a": 3}}\n</tool_call>', '{"a": 3, "b": 2}', '{"a": 1, "b": 2'),
        # ("arguments" after "parameters": the answer takes "arguments")
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}, "arguments": {"days": 2}}', '{"days": 2}', '{"city": "Oslo"}'),
    ]  # fmt: skip
    for answer, final, sent in unsettled:
        parser = "qwen25" if answer.startswith("<") else "llama3"
        assert _final(parser, answer)[0].function.arguments == final
        for pieces in _chunkings(answer):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="minisgl.tool_calls"):
                deltas, _ = _stream(parser, pieces)
            (call,) = streamed_calls(deltas)
            assert call["arguments"] == sent and "differs from the answer's" in caplog.text, pieces


def test_an_answer_that_turns_out_to_be_no_calls_keeps_its_content_exact() -> None:
    """The stream's limit: a call that went out, then text after it (or a cut) makes the whole
    answer text. The content still adds up to the non-streaming content; nothing more is sent."""
    answer = '{"name": "get_time", "parameters": {}} and then'
    splitter = StreamedText(TOOLS, TOOL_CALL_FORMATS["llama3"])
    sent = "".join(splitter.feed(c) for c in answer)
    assert [(c["name"], c["arguments"]) for c in streamed_calls([d.model_dump() for d in splitter.tool_deltas()])] == [("get_time", "{}")]
    rest, calls = splitter.finish()
    assert calls is None and sent + rest == answer and splitter.finish_deltas(calls) == []


# --------------------------------------------------------------------------- the chat route
def test_the_chat_route_streams_each_choices_calls_with_their_own_indexes(tiny_model: str, tmp_path: Any) -> None:
    """n = 2, pieces of both choices interleaved: each choice's calls from index 0, their
    arguments adding up to the non-streamed answer's; a chunk carries one tool delta."""
    answers = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Z\\u00fcrich","days":1e1}}\n</tool_call>',
        'Two calls.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    ]
    pieces = [[answer[k : k + 7] for k in range(0, len(answer), 7)] for answer in answers]
    outs = [
        _out("r", mine[k], k + 1, STOP if k == len(mine) - 1 else None, index=i)
        for k in range(max(map(len, pieces)))
        for i, mine in enumerate(pieces)
        if k < len(mine)
    ]
    client, _ = _client(tiny_model, tmp_path, "qwen25", outs)
    with client:
        chunks = [c for c in _events(_chat_n2(client, stream=True)) if c != "[DONE]"]
    for i, answer in enumerate(answers):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        content, calls = TOOL_CALL_FORMATS["qwen25"].parse(answer, TOOLS)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in mine) == content
        streamed = streamed_calls(tool_deltas(mine))
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
        assert mine[-1]["choices"][0]["finish_reason"] == "tool_calls"
        first_tool = next(j for j, c in enumerate(mine) if "tool_calls" in c["choices"][0]["delta"])
        assert first_tool < len(mine) - 3  # (the calls went out as they came, not all at the end)
    assert streamed_calls(tool_deltas([c for c in chunks if c["choices"] and c["choices"][0]["index"] == 0]))[0]["arguments"] == (
        '{"city": "Zürich", "days": 10.0}'
    )


def _chat_n2(client: Any, **body: Any) -> Any:
    payload = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "tools": [WEATHER, TIME], "n": 2}
    return client.post("/v1/chat/completions", json={**payload, **body})


def test_the_whole_answer_is_unchanged(tiny_model: str, tmp_path: Any) -> None:
    """The non-streaming answer keeps json.dumps(parsed, ensure_ascii=False) as its arguments."""
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Z\\u00fcrich","days":1e1}}\n</tool_call>'
    client, _ = _client(tiny_model, tmp_path, "qwen25", [_out("r", answer, 9, STOP)])
    with client:
        r = client.post("/v1/chat/completions", json={"model": client.model, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == json.dumps({"city": "Zürich", "days": 10.0}, ensure_ascii=False)


def test_a_forced_calls_token_logprobs_go_out_with_its_chunks_in_order(tiny_model: str, tmp_path: Any) -> None:
    """Forced calls' tokens are no longer held to the end with the text: each chunk's logprobs go
    out with it (an empty content delta, as for any text that is not content), all of them, in order."""
    from test_openai_protocol import _scripted_client

    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": ', '"Oslo"}}]']
    outs = [_out("r", p, i + 1, STOP if i == 2 else None) for i, p in enumerate(pieces)]
    for i, out in enumerate(outs):  # one token per piece, with its logprob
        out["meta_info"]["output_token_logprobs"] = [(-0.5 - i, 10 + i, None)]
    client, _ = _scripted_client(tiny_model, tmp_path, outs)
    body = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required",
            "stream": True, "logprobs": True}  # fmt: skip
    with client:
        chunks = [c for c in _events(client.post("/v1/chat/completions", json=body)) if c != "[DONE]"]
    with_logprobs = [c["choices"][0] for c in chunks if c["choices"][0].get("logprobs")]
    assert [t["logprob"] for c in with_logprobs for t in c["logprobs"]["content"]] == [-0.5, -1.5, -2.5]
    assert all(c["delta"] == {"content": ""} for c in with_logprobs)
    assert [(c["name"], c["arguments"]) for c in streamed_calls(tool_deltas(chunks))] == [("get_weather", '{"city": "Oslo"}')]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_auto_call_streamed_or_not(tiny_model: str, tmp_path: Any) -> None:
    """tool_choice "auto" (parsed calls) with parallel_tool_calls false: an answer of two calls
    gives the first alone, whole and streamed alike; the second's markup is no content either."""
    answer = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')  # fmt: skip
    pieces = [answer[k : k + 9] for k in range(0, len(answer), 9)]
    whole, _ = _client(tiny_model, tmp_path, "qwen25", [_out("r", answer, 9, STOP)])
    streamed, _ = _client(tiny_model, tmp_path, "qwen25", [_out("r", p, k + 1, STOP if k == len(pieces) - 1 else None) for k, p in enumerate(pieces)])
    with whole:
        message = _chat(whole, parallel_tool_calls=False).json()["choices"][0]["message"]
        assert len(_chat(whole).json()["choices"][0]["message"]["tool_calls"]) == 2  # (the default: both)
    with streamed:
        chunks = [c for c in _events(_chat(streamed, parallel_tool_calls=False, stream=True)) if c != "[DONE]" and c["choices"]]
    assert message["content"] == "Checking." and [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Checking."
    assert [(c["name"], c["arguments"]) for c in streamed_calls(tool_deltas(chunks))] == [("get_time", "{}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
