"""Qwen3-Coder's tool calls (stage 1, chat only, tool_choice "auto"): the XML-like markup
read whole and streamed, and its values typed by the tools' schemas (SGLang's
function_call/qwen3_coder_detector.py, `--tool-call-parser qwen3_coder`).

Where it sits: tool_parsers.py's QwenCoderFormat is a ToolCallFormat like the JSON ones and
hands its work here: `read_calls` for a whole answer (from its first `<tool_call>` on),
`read_streamed` for a CallStream (tool_call_stream.py), and `typed_arguments` to turn the
text the model wrote into the JSON values the call's `arguments` hold. In: text, and the
offered tools' parameters schemas by name. Out: RawCalls (whole) or StreamedCall pieces.
Owns: nothing.

A call, one function per block (a block may hold several, as SGLang reads them):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text after `<parameter=KEY>` up to the first `</parameter>`, or the first
`<parameter=` or `</function>` that starts a line (Qwen3-Coder drops a `</parameter>` at times;
SGLang and vLLM then end the value at the next tag too), less one leading and one trailing
newline. It is not JSON: `typed_value` gives it the type the tool's `parameters` schema
declares for KEY (SGLang's rules, below). Only blanks may stand between the tags; names hold
no `<` or line break. A parameter written twice keeps its first value (what a stream sent
stands). The last block's `</tool_call>` may be missing (the answer ended after `</function>`:
SGLang and vLLM read it); a missing `</function>`, or anything else, is not calls
(tool_parsers.py's rule: then all content).

Streamed, a call's id and name go out at `<function=NAME>`'s `>`; each parameter's
`"key": value` (with the `{` or `, ` before it) once its `</parameter>` is read, and the
closing `}` at `</function>`: the pieces of json.dumps(arguments, ensure_ascii=False), so
they add up to the non-streamed arguments byte for byte.
"""

from __future__ import annotations

import ast
import json
import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from minisgl.entrypoints.openai.tool_call_stream import CallStream, NotCalls, OfferedTools, Reader, check_offered

logger = logging.getLogger("minisgl.tool_calls")

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# what ends a value: its close, or the next tag on a line of its own (a `</parameter>` dropped).
# All three are 12 characters, so the first one read whole is the one that starts first.
VALUE_ENDS = (PARAMETER_END, "\n" + PARAMETER, "\n" + FUNCTION_END)
# the deepest brackets a container value may nest: deeper is text, whole or streamed alike (Python's
# json and ast recurse, and a stream's reader runs them deeper in the stack than a whole parse)
MAX_DEPTH = 512
_REF_HOPS = 32  # $ref / anyOf steps followed for one type (a schema may refer to itself)

# SGLang's type names (a schema's "type", lowercased): the ones whose value is the text itself
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float")
_CONTAINER_TYPES = ("object", "array", "arr", "dict", "list")  # (prefixes: "dict[str, int]" too)


# --------------------------------------------------------------------------- typing the values
def _parameters(tools: OfferedTools, name: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The parameters schema of the tool named `name` and its `properties` ({} when none)."""
    parameters = tools.get(name)
    parameters = parameters if isinstance(parameters, dict) else {}
    properties = parameters.get("properties")
    return parameters, properties if isinstance(properties, dict) else {}


def _local_ref(root: Mapping[str, Any], ref: str) -> Any:
    """What a local `$ref` ("#/$defs/Unit", "#/definitions/Unit") points to in `root` (None:
    not local, or not there; a remote schema is never fetched)."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")  # (JSON pointer's escapes)
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _enum_type(values: List[Any]) -> Optional[str]:
    """An enum's type when it has none: the JSON type all its values share (null aside; "number"
    for ints and floats together), None when they differ (the text is then kept)."""
    kinds = {"boolean" if isinstance(v, bool) else "integer" if isinstance(v, int) else "number" if isinstance(v, float)
             else "string" if isinstance(v, str) else "other" for v in values if v is not None}  # fmt: skip
    if kinds == {"integer", "number"}:
        return "number"
    return kinds.pop() if len(kinds) == 1 and kinds != {"other"} else None


def _schema_type(schema: Any, root: Mapping[str, Any], hops: int = 0) -> str:
    """A property's type: its "type" lowercased, as SGLang reads it. Where SGLang reads no type
    (and keeps the text), minisgl reads the one the schema gives (pydantic writes Optional[int]
    as an anyOf): a list of types is its first that is not "null"; a local `$ref` the type of
    what it points to; anyOf/oneOf the type of its first branch that is not null; an enum the
    type its values share. "string" without any."""
    if not isinstance(schema, dict) or hops > _REF_HOPS:
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is not None:
        return str(kind).strip().lower()
    if isinstance(schema.get("$ref"), str):
        return _schema_type(_local_ref(root, schema["$ref"]), root, hops + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            kinds = (_schema_type(branch, root, hops + 1) for branch in schema[key])
            return next((k for k in kinds if k != "null"), "string")
    if isinstance(schema.get("enum"), list):
        return _enum_type(schema["enum"]) or "string"
    return "string"


def _depth(raw: str) -> int:
    """How deep `raw`'s brackets nest outside its quoted strings (a backslash escapes in them)."""
    depth = deepest = 0
    quote: Optional[str] = None
    escaped = False
    for ch in raw:
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]})":
            depth -= 1
    return deepest


def typed_value(raw: str, schema: Optional[Any], root: Optional[Mapping[str, Any]] = None) -> Any:
    """The value of a parameter whose text is `raw`, by its property's `schema` (None: a
    parameter the tool's schema does not declare; `root`: the tool's parameters schema, which a
    `$ref` points into). SGLang's rules: `null` (any case) is None whatever
    the type; a string type, an undeclared parameter or one without a type keeps the text;
    integer -> int, number -> int when written without `.` or `e`, else float; boolean ->
    true/false (any case); object/array -> json.loads, else a Python literal; any other type
    -> a Python literal (never evaluated). Text that does not parse as its type stays the text
    (SGLang's too, except a boolean, which SGLang makes false: a silently wrong false is worse
    than a string a client can see is not one), and so does a result with no strict JSON form
    (a set, NaN) and a container nested deeper than MAX_DEPTH."""
    if raw.lower() == "null":
        return None
    if schema is None:
        return raw
    kind = _schema_type(schema, root if root is not None else {})
    if kind in _STRING_TYPES:
        return raw
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(raw)
        except ValueError:  # (not an integer, or past Python's digit limit)
            return _kept(raw, kind)
    if kind.startswith(_NUMBER_PREFIXES):
        return _number(raw, kind)
    if kind in ("boolean", "bool", "binary"):
        word = raw.lower()
        return word == "true" if word in ("true", "false") else _kept(raw, kind)
    if _depth(raw) > MAX_DEPTH:
        return _kept(raw, kind)
    if kind.startswith(_CONTAINER_TYPES):
        try:
            value = json.loads(raw)
            json.dumps(value, allow_nan=False)  # (json.loads takes NaN and Infinity: no JSON values)
            return value
        except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
            pass  # (then a Python literal: `{'a': 1}`, `(1, 2)`, as SGLang tries next)
    return _literal(raw, kind)


def _kept(raw: str, kind: str) -> str:
    logger.warning("Tool-call value %.80r is not of its parameter's type %s: kept as the text", raw, kind)
    return raw


def _number(raw: str, kind: str) -> Any:
    try:
        value = float(raw)
    except ValueError:
        return _kept(raw, kind)
    if not math.isfinite(value):  # ("inf", "nan", 1e999: no JSON number)
        return _kept(raw, kind)
    if value.is_integer() and "." not in raw and "e" not in raw.lower():
        try:
            return int(raw)  # (exact: float would round an integer past 2**53)
        except ValueError:
            return int(value)
    return value


def _literal(raw: str, kind: str) -> Any:
    try:
        value = ast.literal_eval(raw)
        json.dumps(value, allow_nan=False)  # (a set, bytes, complex or 1e999 has no JSON form)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return _kept(raw, kind)
    return value


def typed_arguments(name: str, raw: Dict[str, str], tools: OfferedTools) -> Dict[str, Any]:
    """A call's arguments: each parameter's text typed by the tool's schema."""
    parameters, properties = _parameters(check_offered(tools), name)
    return {key: typed_value(text, properties.get(key), parameters) for key, text in raw.items()}


def _trimmed(value: str) -> str:
    """A value as its parameter holds it: less the one newline after the tag and the one before
    the closing tag (others are the value's own: a multi-line string keeps its blank lines)."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _is_name(text: str) -> bool:
    return bool(text) and "<" not in text and "\n" not in text


# --------------------------------------------------------------------------- a whole answer
def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def read_calls(tail: str) -> Optional[List[Dict[str, Any]]]:
    """The calls in `tail` (the answer from its first `<tool_call>` on), their values the text
    the model wrote ({"name", "arguments": {key: text}}), or None when `tail` is not calls only."""
    calls: List[Dict[str, Any]] = []
    i = 0
    while i < len(tail):
        if not tail.startswith(TOOL_CALL, i):
            return None
        i, in_block = i + len(TOOL_CALL), 0
        while True:
            i = _skip_blanks(tail, i)
            if tail.startswith(FUNCTION, i):
                call, i = _read_function(tail, i + len(FUNCTION))
                if call is None:
                    return None
                calls.append(call)
                in_block += 1
            elif in_block and tail.startswith(TOOL_CALL_END, i):
                i += len(TOOL_CALL_END)
                break
            elif in_block and i == len(tail):
                break  # (the last block's </tool_call> missing)
            else:
                return None
        i = _skip_blanks(tail, i)
    return calls or None


def _read_function(tail: str, i: int) -> Tuple[Optional[Dict[str, Any]], int]:
    """`NAME>` and the parameters up to `</function>`, from `i` (after `<function=`)."""
    end = tail.find(">", i)
    name = tail[i:end]
    if end < 0 or not _is_name(name):
        return None, i
    arguments: Dict[str, str] = {}
    i = end + 1
    while True:
        i = _skip_blanks(tail, i)
        if tail.startswith(FUNCTION_END, i):
            return {"name": name, "arguments": arguments}, i + len(FUNCTION_END)
        if not tail.startswith(PARAMETER, i):
            return None, i
        end = tail.find(">", i + len(PARAMETER))
        key = tail[i + len(PARAMETER) : end]
        if end < 0 or not _is_name(key):
            return None, i
        ends = [(at, mark) for mark in VALUE_ENDS for at in [tail.find(mark, end + 1)] if at >= 0]
        if not ends:
            return None, i
        close, mark = min(ends)
        # (a next tag that ended the value: its newline is the one a `</parameter>` would follow,
        # the value's, which _trimmed drops; reading goes on at the tag)
        i = close + (len(PARAMETER_END) if mark == PARAMETER_END else 1)
        arguments.setdefault(key, _trimmed(tail[end + 1 : close + (mark != PARAMETER_END)]))  # (the first value wins, as streamed)


# --------------------------------------------------------------------------- streamed
def read_streamed(stream: CallStream) -> Reader:
    """The calls as they stream, a character at a time, by read_calls' rules; values typed by
    the tools the stream was made with (`stream.tool_names`: each one's parameters schema)."""
    while True:
        yield from _tag(stream, (TOOL_CALL,))
        yield from _tag(stream, (FUNCTION,))
        while True:  # (the block's functions, up to its </tool_call>)
            yield from _stream_function(stream)
            if (yield from _tag(stream, (FUNCTION, TOOL_CALL_END))) == TOOL_CALL_END:
                break


def _stream_function(stream: CallStream) -> Reader:
    """One function, after its `<function=`: the header at its name's `>`, then each parameter."""
    name = yield from _name(stream)
    call = stream.open_call(name)
    parameters, properties = _parameters(check_offered(stream.tool_names), name)
    keys: List[str] = []
    tag = yield from _tag(stream, (PARAMETER, FUNCTION_END))
    while tag == PARAMETER:
        key = yield from _name(stream)
        text, tag = yield from _value(stream)
        if key not in keys:  # (a repeat: the first value wins, it went out)
            value = typed_value(text, properties.get(key), parameters)
            call.write(("{" if not keys else ", ") + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))
            keys.append(key)
        if tag == PARAMETER_END:  # (out now: the next tag may be long in coming)
            tag = yield from _tag(stream, (PARAMETER, FUNCTION_END))
    call.write("}" if keys else "{}")


def _tag(stream: CallStream, tags: Tuple[str, ...]) -> Reader:
    """After blanks, one of `tags` (none a start of another): which one."""
    text = yield from stream.take_nonblank(json_blanks=False)
    while text not in tags:
        if not any(tag.startswith(text) for tag in tags):
            raise NotCalls
        text += yield from stream.char()
    return text


def _name(stream: CallStream) -> Reader:
    """A function's or parameter's name, through its `>`."""
    chars: List[str] = []
    while True:
        ch = yield from stream.char()
        if ch == ">":
            break
        chars.append(ch)
        if ch in "<\n":
            raise NotCalls
    if not chars:
        raise NotCalls
    return "".join(chars)


def _value(stream: CallStream) -> Reader:
    """A parameter's text and what ended it (one of VALUE_ENDS, read through; the tag a
    newline begins is returned without its newline: PARAMETER or FUNCTION_END)."""
    chars: List[str] = []
    size = len(PARAMETER_END)
    while True:
        ch = yield from stream.char()
        chars.append(ch)
        if ch in ">=" and (mark := "".join(chars[-size:])) in VALUE_ENDS:
            return _trimmed("".join(chars[: -size + (mark != PARAMETER_END)])), mark.lstrip("\n")  # (as read_calls)
