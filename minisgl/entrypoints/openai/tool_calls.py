"""Tool calls (stage 1, chat only): forced (`tool_choice` "required" or a named function,
constrained) and "auto" (parsed from the model's own format).

Where it sits: OpenAIServingChat turns the request's `tools` + `tool_choice` into a JSON
schema (`tool_call_constraint`), which goes down as the request's `json_schema` sampling
key: structured output (docs/structured_output.md) then makes the model write a JSON array
of calls, `[{"name": ..., "parameters": {...}}, ...]`, whatever the model. When the answer
comes back, `parse_tool_calls` turns that array into OpenAI's `tool_calls`.

This is SGLang's path for these two choices (its `get_json_schema_constraint` and
`JsonArrayParser`, which bypass the model-specific parsers). `tool_choice: "auto"` needs a
parser for the model family's own tool-call format (SGLang's --tool-call-parser): the formats
are in tool_parsers.py (qwen25, llama3, mistral, pythonic, qwen3_coder); this file holds what
they share: the structural tag of strict tools (`auto_call_constraint`) and, at its end, the streamed split
of text and calls (`StreamedText`; the calls themselves stream through tool_call_stream.py,
a forced call's too: `forced_call_stream`). Without a parser, "auto" is refused.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional, Tuple

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall, FunctionCall, Tool, ToolCall, ToolChoice
from minisgl.utils import ParamError
from minisgl.entrypoints.openai.tool_call_stream import CallStream, OfferedTools, check_offered, read_forced_calls
from minisgl.entrypoints.openai.tool_parsers import NOT_JSON, TOOL_CALL_FORMATS, ToolCallFormat

_QWEN25 = TOOL_CALL_FORMATS["qwen25"]

AUTO_NOT_BUILT = (
    'tool_choice "auto" (the default when tools are given) needs a parser for this model\'s own tool-call format: '
    "start the server with --tool-call-parser set to the model's format, one of: "
    f"{', '.join(f'{f.name} ({f.models})' for f in TOOL_CALL_FORMATS.values())}; "
    'or use tool_choice "required" or {"type": "function", "function": {"name": ...}} (the call is then constrained '
    'to JSON), or "none"'
)


def validate_tools(request: ChatCompletionRequest, parser: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """SGLang's messages for a tool_choice the tools cannot satisfy (sglang-facts.md §10.1), and
    minisgl's for "auto" without a --tool-call-parser, or with strict tools a format cannot
    constrain, each with the field it is about; None when the request is fine."""
    choice = request.tool_choice
    if not request.tools and choice in (None, "none", "auto"):  # (nothing to call: a plain chat)
        return None
    if choice == "required" and not request.tools:
        return "Tools cannot be empty if tool choice is set to required.", "tools"
    if isinstance(choice, ToolChoice):
        if not request.tools:
            return "Tools cannot be empty if tool choice is set to a specific tool.", "tools"
        if all(tool.function.name != choice.function.name for tool in request.tools):
            return f"Tool '{choice.function.name}' not found in tools list.", "tool_choice"
    if choice in (None, "auto") and parser is None:
        return AUTO_NOT_BUILT, "tool_choice"
    if choice in (None, "auto") and any(t.function.strict for t in request.tools or []) and not TOOL_CALL_FORMATS[parser].has_structural_tag:
        # (SGLang leaves pythonic ones unconstrained: a strict tool's promise would silently not hold;
        # it holds qwen3_coder's with xgrammar's qwen_xml tag, not built here)
        return (
            'strict tools under tool_choice "auto" are constrained by a structural tag, which holds JSON arguments: '
            f"the {parser} format writes {TOOL_CALL_FORMATS[parser].argument_syntax} ones. Drop \"strict\", or use tool_choice \"required\" or a named "
            "function (the call is then constrained to JSON)",
            "tools",
        )
    return None


def _tool_schema(tool: Tool) -> Dict[str, Any]:
    """One call of `tool`: {"name": its name, "parameters": its parameters schema}."""
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


def tool_call_constraint(request: ChatCompletionRequest) -> Optional[str]:
    """The json_schema text the output must match for a forced call, or None when no call is
    forced (no tools, or tool_choice unset, "auto" or "none"). SGLang's shape: an array of at least one call, of
    the named tool or of any tool; at most one with parallel_tool_calls false."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return None
    tools = visible_tools(request)
    if isinstance(choice, ToolChoice):
        items = _tool_schema(tools[0])
    else:  # "required"
        items = {"type": "object", "anyOf": [_tool_schema(t) for t in tools]}
    schema: Dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    # A tool's "#/$defs/X" refs (pydantic's nested models; "#/definitions/X" in draft 7)
    # resolve against the root of the whole schema, where the call array now sits: lift its
    # definitions there (SGLang's rule, one schema per name across the tools)
    for section in ("$defs", "definitions"):
        merged: Dict[str, Any] = {}
        for tool in tools:
            for name, definition in ((tool.function.parameters or {}).get(section) or {}).items():
                if merged.get(name, definition) != definition:
                    raise ParamError(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
                merged[name] = definition
        if merged:
            schema[section] = merged
    return json.dumps(schema)


def auto_call_constraint(request: ChatCompletionRequest, fmt: ToolCallFormat) -> Optional[str]:
    """The structural tag (its JSON text) that constrains "auto" calls when a tool is strict, or None.

    SGLang's: the model writes free text, but from one of the format's triggers on (Qwen's
    `<tool_call>`, Mistral's `[TOOL_CALLS]`, ...), what follows is one of the tools' calls in
    that format, a strict tool's arguments matching its parameters (a tool that is not strict
    takes any JSON object, as the parse keeps only those). Without a strict tool nothing is constrained; validate_tools refused a
    format that has no tag (its arguments are not JSON)."""
    if not request.tools or request.tool_choice not in (None, "auto") or not any(t.function.strict for t in request.tools):
        return None
    structures: List[Dict[str, Any]] = []
    triggers: List[str] = []
    for tool in request.tools:
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        # (a tool that is not strict takes any arguments the parse keeps: any object, where its parameters are one)
        schema = parameters if tool.function.strict else {"type": "object"} if parameters.get("type", "object") == "object" else {}
        # (the name as JSON: a `"` in it would have made the only allowed call invalid JSON)
        for begin, end, trigger in fmt.structures(json.dumps(tool.function.name, ensure_ascii=False)):
            structures.append({"begin": begin, "schema": schema, "end": end})
            triggers += [trigger] if trigger not in triggers else []
    if not structures:
        raise ValueError(f"the {fmt.name} tool-call format has no structural tag")  # (validate_tools said so first)
    return json.dumps({"structures": structures, "triggers": triggers})


def visible_tools(request: ChatCompletionRequest) -> List[Tool]:
    """The tools the template shows and the call may use: all of them, or only the named one (SGLang's)."""
    choice = request.tool_choice
    if isinstance(choice, ToolChoice):
        return [t for t in request.tools or [] if t.function.name == choice.function.name][:1]
    return list(request.tools or [])


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_call_stream() -> CallStream:
    """The stream of a forced call's answer, the JSON array `parse_tool_calls` reads whole: each
    call once its name and its "parameters" key are read (any name: the grammar holds them to
    the tools, and parse_tool_calls takes them as written)."""
    return CallStream(read_forced_calls, None, _call_id, arg_keys=("parameters",), needs_arg_key=True)


def parse_tool_calls(text: str) -> Optional[List[ToolCall]]:
    """The calls in a forced answer (a JSON array of {"name", "parameters"}), or None when the text is
    not one: an answer cut by max_tokens or a stop string is not a call, and is returned as content."""
    try:
        calls = json.loads(text)
    except NOT_JSON:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in calls):
        return None
    try:
        return [
            # (ensure_ascii off: "Zürich" as OpenAI and SGLang send it, not "Z\\u00fcrich")
            ToolCall(id=_call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)))
            for c in calls
        ]
    except RecursionError:  # (decoded just under the limit, encoded just over it)
        return None


# --------------------------------------------------------------------------- tool_choice "auto"
# Model families' own tool-call formats (SGLang's --tool-call-parser; tool_parsers.py). With
# "auto" nothing is constrained (unless a tool is strict): the model writes text, calls in its
# format, or both, and the format splits them.
def parse_qwen25(text: str, tool_names: OfferedTools) -> Tuple[str, Optional[List[ToolCall]]]:
    """Qwen2.5 / Qwen3's format (ToolCallFormat.parse says the rules): (the text before the first
    `<tool_call>`, the calls), or (text, None)."""
    return _QWEN25.parse(text, tool_names)


class StreamedText:
    """Splits a streamed answer of tool_choice "auto" into the content to send now and the tool
    calls: text that could be the start of a call (or of one of the format's special tokens)
    waits until it is known, and so do blanks that may end the text before a call (the
    answer's content drops them), so that a stream sends exactly the non-streaming answer's
    content. From the first call markup on, the text goes to the format's CallStream, whose
    deltas `tool_deltas` hands out (a call once its name is read, then its arguments as they
    come), and `finish_deltas` settles them against the whole answer's calls. `tool_names`: the
    functions offered (the chat route's: each one's parameters schema by name, which qwen3_coder
    needs); `fmt`: the model family's format (qwen25's when not given)."""

    def __init__(self, tool_names: OfferedTools, fmt: Optional[ToolCallFormat] = None) -> None:
        self.tool_names = check_offered(tool_names)
        self.format = fmt or _QWEN25
        # everything fed, as pieces: joined once at the end (`full`), since adding each delta to
        # one string copies the answer so far every time (quadratic in a long answer)
        self.pieces: List[str] = []
        # invariant: full[:safe] holds no call start and ends where no marker or special token
        # straddles, so its content is content(full)'s prefix whatever comes next
        self.safe = 0
        self.tail = ""  # full[safe:] until the calls begin: what may still grow into markup (short)
        self.sent: List[str] = []  # what feed() gave out: always a prefix of the final content
        self.blanks = ""  # the content's trailing blanks, held: they may end the text before a call
        self.calls_from: Optional[int] = None  # where the calls begin in `full`
        self.calls: Optional[CallStream] = None  # reads them as they come, from calls_from on
        self.deltas: List[DeltaToolCall] = []  # the calls' deltas not handed out yet

    def feed(self, delta: str) -> str:
        """The part of `delta` (with what was held back) that is content for sure."""
        self.pieces.append(delta)
        if self.calls is not None:
            self.deltas += self.calls.feed(delta)
            return ""
        tail = self.tail + delta
        # (the answer's opening: nothing sent yet, so what came before was blanks, or special
        # tokens, which for a format that reads `at_start` begin its calls)
        start = self.format.find_start(tail, at_start=not self.sent)
        if start >= 0:
            end = start
            self.calls_from = self.safe + start
            self.calls = self.format.stream(self.tool_names)
            self.deltas += self.calls.feed(tail[start:])
        else:
            end = len(tail) - self.format.held(tail)
        text = self.blanks + self.format.content(tail[:end])
        sure = text.rstrip()
        self.safe, self.tail, self.blanks = self.safe + end, tail[end:], text[len(sure) :]
        if sure:
            self.sent.append(sure)
        return sure

    @property
    def full(self) -> str:
        """Everything fed."""
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def tool_deltas(self) -> List[DeltaToolCall]:
        """The calls' deltas since the last call: to send after the content `feed` gave out."""
        deltas, self.deltas = self.deltas, []
        return deltas

    def finish_deltas(self, calls: Optional[List[ToolCall]]) -> List[DeltaToolCall]:
        """At the end: the deltas still owed, given the answer's calls (`finish`'s; None when
        it holds none, or was cut short)."""
        return self.tool_deltas() + (self.calls.finish(calls) if self.calls is not None else [])

    def unsent(self) -> str:
        """Everything fed and not given out (an answer cut short: all of it is content)."""
        return self.format.content(self.full)[sum(map(len, self.sent)) :]

    def finish(self) -> Tuple[str, Optional[List[ToolCall]]]:
        """At the end of the choice: (content still to send, the calls or None)."""
        if self.calls_from is None:
            return self.unsent(), None
        content, calls = self.format.parse(self.full, self.tool_names)
        sent = "".join(self.sent)
        return content[len(sent) :] if content.startswith(sent) else "", calls
