"""tool_choice "auto" for every --tool-call-parser format (entrypoints/openai/tool_parsers.py).

Per format, a table of answers and what they must come back as (text, calls, a function
not offered, text before the calls, malformed or cut answers); a stream must send exactly
the non-streaming content over any chunking; a strict tool's structural tag compiles with
xgrammar and allows only what the format's parser reads as that call; and the chat route,
on scripted outputs, returns the same through HTTP. qwen25's own tests are in
tests/test_tool_calls.py.
"""

from __future__ import annotations

import json
import random
from typing import Any, Dict, List, Optional, Tuple

import pytest

from test_openai_fields import _events
from test_openai_protocol import _out, _scripted_client

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest
from minisgl.entrypoints.openai.tool_calls import StreamedText, auto_call_constraint, validate_tools
from minisgl.entrypoints.openai.tool_parsers import TOOL_CALL_FORMATS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# qwen3_coder's values are text, typed by the tool's schema: one parameter of each type
RECORD = {"type": "function", "function": {"name": "record", "parameters": {"type": "object", "properties": {
    "note": {"type": "string"}, "zip": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "on": {"type": "boolean"}, "meta": {"type": "object"}, "tags": {"type": "array"}, "maybe": {"type": ["string", "null"]},
    "free": {"description": "no type: text"},
    # a type given another way (pydantic writes Optional[int] as an anyOf), and one that is not
    "opt": {"anyOf": [{"type": "null"}, {"type": "integer"}]}, "unit": {"$ref": "#/$defs/Unit"},
    "flag": {"oneOf": [{"$ref": "#/definitions/Flag"}, {"type": "string"}]}, "level": {"enum": [1, 2.5]},
    "mixed": {"enum": [1, "a"]}, "loop": {"$ref": "#/$defs/Loop"}},
    "$defs": {"Unit": {"type": "number"}, "Loop": {"$ref": "#/$defs/Loop"}}, "definitions": {"Flag": {"type": "boolean"}}}}}  # fmt: skip
# the offered functions as the chat route gives them to a format: each one's parameters schema by name
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, RECORD)}
STOP = {"type": "stop", "matched": 2}
Calls = Optional[List[Tuple[str, Dict[str, Any]]]]

# (answer, content, calls): what each format's parser must make of a whole answer
EXAMPLES: Dict[str, List[Tuple[str, str, Calls]]] = {
    "qwen25": [
        ("Just text.", "Just text.", None),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>', "Let me check.", [("get_weather", {"city": "Zürich"})]),
    ],
    "llama3": [
        ("Just text, {not a call}.", "Just text, {not a call}.", None),
        ('{"name": "get_weather", "parameters": {"city": "Zürich"}}', "", [("get_weather", {"city": "Zürich"})]),
        ('\n {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "arguments": {}}',
         "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),  # fmt: skip
        ('Let me check. <|python_tag|>{"name": "get_time", "parameters": {}}', "Let me check.", [("get_time", {})]),
        ('<|python_tag|>{"name": "get_time"};{"name": "get_weather", "parameters": {"city": "Oslo"}};', "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
        ('{"name": "rm_rf", "parameters": {}}', "", None),  # (dropped: not offered)
        ('Sure.<|python_tag|>{"name": "rm_rf", "parameters": {}}; {"name": "get_time", "parameters": {}}', "Sure.", [("get_time", {})]),
        ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', None),  # (JSON that names no arguments: an answer)
        ('{"name": "get_time", "parameters": {}} and then', '{"name": "get_time", "parameters": {}} and then', None),
        ('{"name": "get_weather", "parameters": {"ci', '{"name": "get_weather", "parameters": {"ci', None),  # (cut)
        ("Run it: <|python_tag|>print(2 + 2)", "Run it: print(2 + 2)", None),  # (code, not a call: the tag never is content)
        # (a bare call after text: the strict tools' tag forces one there, so it is read as one)
        ('Text first {"name": "get_time", "parameters": {}}', "Text first", [("get_time", {})]),
        ('Here is the JSON: {"name": "Ada", "age": 36}', 'Here is the JSON: {"name": "Ada", "age": 36}', None),
        ('{"name": "get_time", "parameters": {}}\n{"name": "get_weather", "parameters": {"city": "Oslo"}}',
         "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),  # (a call per line, as SGLang reads too)
        ('{"name": "get_time", "parameters": {"x": ' + "[" * 3000 + "]" * 3000 + "}}", '{"name": "get_time", "parameters": {"x": ' + "[" * 3000 + "]" * 3000 + "}}", None),  # (too deep for json: text, no 500)
    ],
    "mistral": [
        ("Just text [with brackets].", "Just text [with brackets].", None),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "a1b2c3d4e"}]', "", [("get_weather", {"city": "Zürich"})]),
        ('I will look.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
         "I will look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),  # fmt: skip
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        ('Hm. [TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]', "Hm.", None),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}] Done.', ' [{"name": "get_time", "arguments": {}}] Done.', None),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', ' [{"name": "get_weather", "arguments": {"ci', None),  # (cut)
        ("[TOOL_CALLS]get_time{}", "get_time{}", None),  # (no [ARGS])
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}][TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
         "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),  # (one array per call: what the strict tag writes)
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Os', 'get_weather{"city": "Os', None),  # (cut: [ARGS] is a special token too)
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": ' + "[" * 3000 + "]" * 3000 + "}]", ' [{"name": "get_time", "arguments": ' + "[" * 3000 + "]" * 3000 + "}]", None),
    ],
    "pythonic": [
        ("See [the docs](https://x.y) and [a, b].", "See [the docs](https://x.y) and [a, b].", None),
        ('[get_weather(city="Zürich")]', "", [("get_weather", {"city": "Zürich"})]),
        ("Checking. [get_weather(city='Oslo'), get_time()]", "Checking.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        ('<|python_start|>[get_weather(city="Paris", days=-2, hours=(1, 2), raw=None, ok=True, opts={"u": 1.5})]<|python_end|>',
         "", [("get_weather", {"city": "Paris", "days": -2, "hours": [1, 2], "raw": None, "ok": True, "opts": {"u": 1.5}})]),  # fmt: skip
        ("Sure. [rm_rf(path='/')]", "Sure.", None),
        ('[get_weather("Paris")]', '[get_weather("Paris")]', None),  # (positional: no parameter name)
        ('[get_weather(city=__import__("os").getcwd())]', '[get_weather(city=__import__("os").getcwd())]', None),  # (never eval'd)
        ("[get_time(), print(x) for x in y]", "[get_time(), print(x) for x in y]", None),
        ("[get_time()] and more", "[get_time()] and more", None),
        ("[get_weather(city='Pa", "[get_weather(city='Pa", None),  # (cut)
        ("Code: <|python_start|>x = [f(1) for f in g]<|python_end|>", "Code: x = [f(1) for f in g]", None),
        ("[" + "a" * 70 + "()]", "[" + "a" * 70 + "()]", None),  # (no function name is longer than 64 characters)
    ],
}

def _coder(name: str, *params: Tuple[str, str]) -> str:
    """A qwen3_coder call as the model writes it: each value on lines of its own."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_OSLO = _coder("get_weather", ("city", "Oslo"))
EXAMPLES["qwen3_coder"] = [
    ("Just text, <b>tags</b> and <tool>.", "Just text, <b>tags</b> and <tool>.", None),
    ("Let me check.\n" + _coder("get_weather", ("city", "Zürich")), "Let me check.", [("get_weather", {"city": "Zürich"})]),
    (_OSLO + "\n" + _coder("get_time"), "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # every schema type; a string keeps its text (less one newline each side: the blank lines
    # and indent of a multi-line one stay), a number-like string too; an undeclared parameter,
    # or one without a type, is text; null is None whatever the type
    (_coder("record", ("note", "\ndef f():\n    return 1\n"), ("zip", "01234"), ("count", "-42"), ("ratio", "2.50"), ("on", "True"),
            ("meta", '{"a": [1, null], "b": "ü"}'), ("tags", "['x', 2]"), ("maybe", "7"), ("free", "[1, 2]"), ("extra", "5"), ("zip2", "null")),
     "", [("record", {"note": "\ndef f():\n    return 1\n", "zip": "01234", "count": -42, "ratio": 2.5, "on": True,
                      "meta": {"a": [1, None], "b": "ü"}, "tags": ["x", 2], "maybe": "7", "free": "[1, 2]", "extra": "5", "zip2": None})]),
    (_coder("record", ("ratio", "12345678901234567890"), ("count", "-0"), ("maybe", "null"), ("on", "false"), ("meta", "NULL"), ("note", "Null")), "",
     [("record", {"ratio": 12345678901234567890, "count": 0, "maybe": None, "on": False, "meta": None, "note": None})]),
    # anyOf/oneOf: the first branch that is not null; a local $ref: what it points to; an enum
    # without a type: its values' (the text when they differ, or a $ref loops)
    (_coder("record", ("opt", "007"), ("unit", "2.5"), ("flag", "TRUE"), ("level", "2"), ("mixed", "1"), ("loop", "3")), "",
     [("record", {"opt": 7, "unit": 2.5, "flag": True, "level": 2, "mixed": "1", "loop": "3"})]),
    # a value that does not parse as its type stays the text the model wrote
    (_coder("record", ("count", "many"), ("ratio", "inf"), ("on", "yes"), ("meta", "{not json"), ("tags", "{1, 2}"), ("opt", "NaN")),
     "", [("record", {"count": "many", "ratio": "inf", "on": "yes", "meta": "{not json", "tags": "{1, 2}", "opt": "NaN"})]),
    # json.loads takes NaN and Infinity, which no JSON value is: the text
    (_coder("record", ("meta", '{"a": NaN}'), ("tags", "[1, -Infinity]")), "", [("record", {"meta": '{"a": NaN}', "tags": "[1, -Infinity]"})]),
    # brackets nested past 512 (qwen3_coder_calls.MAX_DEPTH) are text, whole and streamed alike;
    # up to it, and brackets inside a string, are the value
    (_coder("record", ("meta", "[" * 3000 + "]" * 3000)), "", [("record", {"meta": "[" * 3000 + "]" * 3000})]),
    (_coder("record", ("tags", "[" * 513 + "]" * 513)), "", [("record", {"tags": "[" * 513 + "]" * 513})]),
    (_coder("record", ("tags", "[" * 512 + "]" * 512), ("meta", '{"s": "' + "[" * 600 + '"}')), "",
     [("record", {"tags": json.loads("[" * 512 + "]" * 512), "meta": {"s": "[" * 600}})]),
    # markup inside a value is the value's: only </parameter> ends it
    (_coder("record", ("note", "if a < b:\n    s = '</function></tool_call>'")), "", [("record", {"note": "if a < b:\n    s = '</function></tool_call>'"})]),
    # a repeated parameter: the first value (a stream sent it)
    (_coder("get_weather", ("city", "Oslo"), ("city", "Paris")), "", [("get_weather", {"city": "Oslo"})]),
    ("Sure. " + _coder("rm_rf", ("path", "/")), "Sure.", None),  # (not offered: dropped)
    (_coder("rm_rf") + _OSLO, "", [("get_weather", {"city": "Oslo"})]),
    ("<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
     "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),  # (two functions in one block: SGLang reads them)
    # the last </tool_call> missing: SGLang (and vLLM) read the call
    (_OSLO[: -len("</tool_call>")], "", [("get_weather", {"city": "Oslo"})]),
    ("Hi. " + _OSLO + "\n" + _coder("get_time")[: -len("\n</tool_call>")], "Hi.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # not calls: all text
    (_OSLO + "\nDone.", _OSLO + "\nDone.", None),
    (_OSLO[: -len("</function>\n</tool_call>")], _OSLO[: -len("</function>\n</tool_call>")], None),  # (cut: no </function>)
    # a </parameter> dropped (Qwen3-Coder does): the value ends at the next <parameter= or
    # </function> that starts a line, as SGLang and vLLM read it; elsewhere on a line they are text
    (_OSLO.replace("</parameter>\n", ""), "", [("get_weather", {"city": "Oslo"})]),
    (_coder("record", ("note", "Paris"), ("count", "3")).replace("</parameter>\n", "", 1), "", [("record", {"note": "Paris", "count": 3})]),
    (_coder("record", ("note", "Paris"), ("count", "3")).replace("3\n</parameter>", "3"), "", [("record", {"note": "Paris", "count": 3})]),
    (_coder("record", ("note", "a"), ("count", "3")).replace("</parameter>\n", ""), "", [("record", {"note": "a", "count": 3})]),
    (_coder("record", ("note", "x = '<parameter=count>' </function>"), ("count", "3")).replace("</parameter>\n", "", 1), "",
     [("record", {"note": "x = '<parameter=count>' </function>", "count": 3})]),
    (_coder("record", ("note", "two\n\nlines\n"), ("count", "3")).replace("</parameter>\n", "", 1), "",
     [("record", {"note": "two\n\nlines\n", "count": 3})]),
    (_OSLO.replace("\n</parameter>\n</function>", "</function>"), _OSLO.replace("\n</parameter>\n</function>", "</function>"), None),  # (not on a line of its own)
    ("<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", None),
    (_OSLO[len("<tool_call>\n") : -len("\n</tool_call>")], _OSLO[len("<tool_call>\n") : -len("\n</tool_call>")], None),  # (bare: as SGLang)
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "<tool_call>\n<function=>\n</function>\n</tool_call>", None),
    ("<tool_call>\nget_weather(city='Oslo')\n</tool_call>", "<tool_call>\nget_weather(city='Oslo')\n</tool_call>", None),
]
CASES = [(name, *case) for name, cases in EXAMPLES.items() for case in cases]


def _request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def _calls(calls: Any) -> Calls:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls] if calls else None


def streamed_calls(deltas: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """A stream's tool-call deltas (as sent, JSON) put together as a client does, each checked
    for OpenAI's shape: a call's first delta {index, id, type, function: {name, arguments: ""}},
    then {index, function: {arguments: piece}}. Returns [{"id", "name", "arguments"}] by index."""
    calls: List[Dict[str, str]] = []
    for delta in deltas:
        if "id" in delta:
            assert set(delta) == {"index", "id", "type", "function"} and delta["type"] == "function", delta
            assert delta["index"] == len(calls) and delta["function"]["arguments"] == "" and delta["function"]["name"], delta
            calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
        else:
            assert set(delta) == {"index", "function"} and list(delta["function"]) == ["arguments"], delta
            assert delta["function"]["arguments"] and delta["index"] < len(calls), delta
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls


def tool_deltas(chunks: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The tool-call deltas of a stream's chunks (one a chunk: the openai SDK merges a chunk's list by index)."""
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    assert all(d is None or len(d) == 1 for d in deltas)
    return [d[0] for d in deltas if d]


def test_the_formats_are_the_parsers_the_server_takes() -> None:
    from minisgl.server_args import TOOL_CALL_PARSERS, ServerArgs

    assert tuple(TOOL_CALL_FORMATS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="--tool-call-parser must be one of qwen25, llama3, mistral, pythonic, qwen3_coder"):
        ServerArgs(tool_call_parser="hermes")


@pytest.mark.parametrize("parser, answer, content, calls", CASES)
def test_a_whole_answer_splits_into_content_and_calls(parser: str, answer: str, content: str, calls: Calls) -> None:
    got_content, got_calls = TOOL_CALL_FORMATS[parser].parse(answer, TOOLS)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert got_calls is None or all(c.id for c in got_calls)


@pytest.mark.parametrize("parser, answer, content, calls", CASES)
def test_a_stream_sends_exactly_the_whole_answers_content(parser: str, answer: str, content: str, calls: Calls) -> None:
    """Any chunking, one character at a time included: the deltas add up to the content, and
    nothing sent is ever taken back by what comes after."""
    fmt, rng = TOOL_CALL_FORMATS[parser], random.Random(answer)
    chunkings = [list(range(1, len(answer)))] + [sorted(rng.sample(range(1, len(answer)), k=min(k, len(answer) - 1))) for k in (1, 2, 3, 5, 8) * 6]
    for cuts in chunkings:
        splitter = StreamedText(TOOLS, fmt)
        sent = "".join(splitter.feed(answer[i:j]) for i, j in zip([0] + cuts, cuts + [len(answer)]))
        rest, got = splitter.finish()
        assert (sent + rest, _calls(got)) == (content, calls), cuts
        assert sent == content[: len(sent)]


@pytest.mark.parametrize("parser", ["llama3", "mistral", "pythonic"])
def test_a_stream_cut_short_is_all_content_without_the_formats_special_tokens(parser: str) -> None:
    fmt = TOOL_CALL_FORMATS[parser]
    for answer, _, calls in EXAMPLES[parser]:
        splitter = StreamedText(TOOLS, fmt)
        sent = splitter.feed(answer[: len(answer) // 2]) + splitter.feed(answer[len(answer) // 2 :])
        assert sent + splitter.unsent() == fmt.content(answer)
        assert not any(token in sent + splitter.unsent() for token in fmt.special)


def test_text_streams_out_before_the_calls_are_known() -> None:
    """Only what may still begin a call waits: a llama3 answer's JSON opening, a `[` that may
    begin `[TOOL_CALLS]` or a pythonic call."""
    llama = StreamedText(TOOLS, TOOL_CALL_FORMATS["llama3"])
    assert llama.feed("It is ") == "It is" and llama.feed("{warm}. <|python") == " {warm}." and llama.feed("_tag|>{") == ""
    opening = StreamedText(TOOLS, TOOL_CALL_FORMATS["llama3"])
    assert opening.feed(" \n") == "" and opening.feed('{"name": ') == "" and opening.calls_from == 2
    mistral = StreamedText(TOOLS, TOOL_CALL_FORMATS["mistral"])
    assert mistral.feed("See [") == "See" and mistral.feed("1] and [TOOL_") == " [1] and" and mistral.feed("CALLS]") == ""
    pythonic = StreamedText(TOOLS, TOOL_CALL_FORMATS["pythonic"])
    assert pythonic.feed("A [get_wea") == "A" and pythonic.feed("ther] b") == " [get_weather] b" and pythonic.feed(" [f(") == ""
    coder = StreamedText(TOOLS, TOOL_CALL_FORMATS["qwen3_coder"])
    assert coder.feed("See <tool") == "See" and coder.feed("s> and <b>") == " <tools> and <b>" and coder.feed("\n<tool_call>") == ""


@pytest.mark.parametrize("parser", list(TOOL_CALL_FORMATS))
def test_the_formats_need_the_tools_schemas_not_their_names(parser: str) -> None:
    """qwen3_coder's values are typed by the schemas: names alone would make every value text.
    A caller's bug, refused where the tools are handed in (not deep in a stream's reader)."""
    with pytest.raises(TypeError, match="mapping of each function's name to its parameters schema, not set"):
        TOOL_CALL_FORMATS[parser].parse(_OSLO, {"get_weather"})
    with pytest.raises(TypeError, match="mapping of each function's name to its parameters schema"):
        StreamedText({"get_weather"}, TOOL_CALL_FORMATS[parser])
    with pytest.raises(TypeError, match="not list"):
        TOOL_CALL_FORMATS[parser].stream(["get_weather"])


def test_mistral_call_ids_are_what_its_template_takes_back() -> None:
    """Mistral's template raises on the next turn unless an id is 9 letters or digits."""
    _, calls = TOOL_CALL_FORMATS["mistral"].parse('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', TOOLS)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


# --------------------------------------------------------------------------- strict tools: the structural tag
@pytest.mark.parametrize(
    "parser, call, other",
    [
        ("qwen25", '<tool_call>\n{"name":"get_weather", "arguments":{"city": "%s"}}\n</tool_call>', '<tool_call>\n{"name":"get_time", "arguments":{"x": [1]}}\n</tool_call>'),
        ("llama3", '<|python_tag|>{"name":"get_weather", "parameters":{"city": "%s"}}', '{"name":"get_time", "parameters":{"x": [1]}}'),
        ("mistral", '[TOOL_CALLS] [{"name":"get_weather", "arguments":{"city": "%s"}}]', '[TOOL_CALLS] [{"name":"get_time", "arguments":{"x": [1]}}]'),
        ("llama3", '{"name":"get_weather", "parameters":{"city": "%s"}}', '<|python_tag|>{"name":"get_time", "parameters":{"x": [1]}}'),
    ],
)
def test_a_strict_tools_tag_allows_only_calls_its_parser_reads(parser: str, call: str, other: str, tiny_model: str) -> None:
    """The tag compiles; what it lets through after some text is a call the parser reads, a
    strict tool's arguments matching its parameters (a tool that is not strict takes any JSON object)."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from minisgl.constrained.xgrammar_backend import XGrammarGrammarBackend

    fmt = TOOL_CALL_FORMATS[parser]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    tag = auto_call_constraint(_request(tools=[strict, TIME]), fmt)
    assert auto_call_constraint(_request(tools=[WEATHER, TIME]), fmt) is None  # (no strict tool: free)
    backend = XGrammarGrammarBackend(AutoTokenizer.from_pretrained(tiny_model), 512, [0])
    try:
        future = backend.get_future(("structural_tag", tag))
        future.result(60)

        def accepts(text: str) -> bool:  # (a fresh matcher each time)
            return backend.get_grammar(future).matcher.accept_string(text)

        for text in (call % "Paris", "Sure. " + call % "Oslo", other):
            assert accepts(text), text
        assert not accepts(call % "Rome") and not accepts(call.replace("get_weather", "rm_rf") % "Paris")
        assert not accepts(other.replace('{"x": [1]}', "[1]"))  # (any JSON object: arguments are one, as the parse holds them)
        content, calls = fmt.parse("Sure. " + call % "Oslo", TOOLS)
        assert (content, _calls(calls)) == ("Sure.", [("get_weather", {"city": "Oslo"})])
        # parallel calls, as the tag lets them be written, are all read back
        assert accepts(call % "Oslo" + other) and _calls(fmt.parse(call % "Oslo" + other, TOOLS)[1]) == [("get_weather", {"city": "Oslo"}), ("get_time", {"x": [1]})]
        if parser == "llama3":  # the bare JSON Meta's template asks for is held too (minisgl's trigger)
            assert accepts('{"name":"get_weather", "parameters":{"city": "Oslo"}}')
            assert not accepts('{"name":"get_weather", "parameters":{"city": "Rome"}}')
    finally:
        backend.shutdown()


def test_pythonic_strict_tools_under_auto_are_refused_not_left_unconstrained() -> None:
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    error = validate_tools(_request(tools=[strict]), "pythonic")
    assert error is not None and "pythonic format writes Python ones" in error[0] and error[1] == "tools"
    assert validate_tools(_request(tools=[WEATHER]), "pythonic") is None
    assert validate_tools(_request(tools=[strict], tool_choice="required"), "pythonic") is None  # (forced: JSON)
    assert validate_tools(_request(tools=[strict]), "mistral") is None
    error = validate_tools(_request(tools=[strict]), "qwen3_coder")  # (its values are not JSON either)
    assert error is not None and "qwen3_coder format writes XML-like <parameter=...> ones" in error[0] and error[1] == "tools"
    assert validate_tools(_request(tools=[strict], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "qwen3_coder") is None


# --------------------------------------------------------------------------- the chat route, scripted
def _client(tiny_model: str, tmp_path: Any, parser: str, outs: List[Dict[str, Any]]) -> Any:
    from minisgl.server_args import ServerArgs, resolve_server_args

    args = resolve_server_args(ServerArgs(model_path=tiny_model, device="cpu", tool_call_parser=parser))
    return _scripted_client(tiny_model, tmp_path, outs, server_args=args)


def _chat(client: Any, **body: Any) -> Any:
    payload: Dict[str, Any] = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "tools": [WEATHER, TIME]}
    return client.post("/v1/chat/completions", json={**payload, **body})


ROUTE_CASES = [
    ("llama3", 'On it. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}', "On it."),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Zürich"}}', None),
    ("mistral", 'On it. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}]', "On it."),
    ("pythonic", 'On it. [get_weather(city="Zürich")]', "On it."),
    ("qwen3_coder", "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>", "On it."),
    ("qwen3_coder", "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</function>\n</tool_call>", "On it."),  # (</parameter> dropped)
]


@pytest.mark.parametrize("parser, answer, content", ROUTE_CASES)
def test_the_chat_route_returns_the_formats_calls_streamed_or_not(tiny_model: str, tmp_path: Any, parser: str, answer: str, content: Optional[str]) -> None:
    client, seen = _client(tiny_model, tmp_path, parser, [_out("r", answer, 15, STOP)])
    with client:
        whole = _chat(client).json()["choices"][0]
    pieces = [answer[:9], answer[9:20], answer[20:]]  # (the first ends inside the markup or the JSON)
    client, _ = _client(tiny_model, tmp_path, parser, [_out("r", p, 5 * (i + 1), STOP if i == 2 else None) for i, p in enumerate(pieces)])
    with client:
        chunks = [c for c in _events(_chat(client, stream=True)) if c != "[DONE]"]
    assert seen[0].sampling_params["skip_special_tokens"] is False
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == content
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    (streamed,) = streamed_calls(tool_deltas(chunks))
    assert {"name": streamed["name"], "arguments": streamed["arguments"]} == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser, answer, content", ROUTE_CASES)
def test_the_chat_route_keeps_cut_or_undefined_calls_out_of_tool_calls(tiny_model: str, tmp_path: Any, parser: str, answer: str, content: Optional[str]) -> None:
    """Cut by max_tokens: all content, the format's special tokens dropped. A function not
    offered: dropped, the text before it the answer, finish "stop"; streamed alike."""
    fmt = TOOL_CALL_FORMATS[parser]
    client, _ = _client(tiny_model, tmp_path, parser, [_out("r", answer, 9, {"type": "length", "length": 9})])
    with client:
        cut = _chat(client).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == fmt.content(answer) and cut["message"]["tool_calls"] is None
    rogue = answer.replace("get_weather", "rm_rf")
    client, _ = _client(tiny_model, tmp_path, parser, [_out("r", rogue, 9, STOP)])
    with client:
        whole = _chat(client).json()["choices"][0]
    client, _ = _client(tiny_model, tmp_path, parser, [_out("r", rogue[:12], 3), _out("r", rogue[12:], 9, STOP)])
    with client:
        chunks = [c for c in _events(_chat(client, stream=True)) if c != "[DONE]"]
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == (content or "") and whole["message"]["tool_calls"] is None
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "") and not any("tool_calls" in d for d in deltas)


def test_the_chat_route_types_qwen3_coder_values_by_the_requests_tools(tiny_model: str, tmp_path: Any) -> None:
    """The request's own schemas reach the parser: "3" is an integer for `count`, "007" stays a string
    for `zip`, "5" is an integer for pydantic's Optional[int] (an anyOf), "2.5" a number through a $ref."""
    answer = "Noted.\n" + _coder("record", ("count", "3"), ("zip", "007"), ("opt", "5"), ("unit", "2.5"))
    client, _ = _client(tiny_model, tmp_path, "qwen3_coder", [_out("r", answer, 15, STOP)])
    with client:
        (call,) = _chat(client, tools=[RECORD]).json()["choices"][0]["message"]["tool_calls"]
    client, _ = _client(tiny_model, tmp_path, "qwen3_coder", [_out("r", answer[:30], 5), _out("r", answer[30:], 15, STOP)])
    with client:
        (streamed,) = streamed_calls(tool_deltas([c for c in _events(_chat(client, tools=[RECORD], stream=True)) if c != "[DONE]"]))
    assert call["function"] == {"name": "record", "arguments": '{"count": 3, "zip": "007", "opt": 5, "unit": 2.5}'}
    assert streamed["arguments"] == call["function"]["arguments"]


def test_strict_tools_under_auto_reach_the_scheduler_as_the_formats_tag(tiny_model: str, tmp_path: Any) -> None:
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    client, seen = _client(tiny_model, tmp_path, "mistral", [_out("r", "Fine.", 2, STOP)])
    with client:
        assert _chat(client, tools=[strict, TIME]).status_code == 200
    tag = json.loads(seen[0].sampling_params["structural_tag"])
    assert tag["triggers"] == ["[TOOL_CALLS]"] and [s["schema"] for s in tag["structures"]] == [WEATHER["function"]["parameters"], {"type": "object"}]
    client, seen = _client(tiny_model, tmp_path, "pythonic", [_out("r", "Fine.", 2, STOP)])
    with client:
        r = _chat(client, tools=[strict, TIME])
    assert r.status_code == 400 and 'Drop "strict"' in r.json()["error"]["message"] and seen == []
