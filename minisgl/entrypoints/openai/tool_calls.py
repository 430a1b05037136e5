"""Tool calls (stage 1, chat only): forced (`tool_choice` "required" or a named function,
constrained) and "auto" (parsed from the model's own format).

Where it sits: OpenAIServingChat turns the request's `tools` + `tool_choice` into a JSON
schema (`tool_call_constraint`), which goes down as the request's `json_schema` sampling
key: structured output (docs/structured_output.md) then makes the model write a JSON array
of calls, `[{"name": ..., "parameters": {...}}, ...]`, whatever the model. When the answer
comes back, `parse_tool_calls` turns that array into OpenAI's `tool_calls`.

This is SGLang's path for these two choices (its `get_json_schema_constraint` and
`JsonArrayParser`, which bypass the model-specific parsers). `tool_choice: "auto"` needs a
parser for the model family's own tool-call format (SGLang's --tool-call-parser): minisgl
has Qwen2.5/Qwen3's (`<tool_call>{...}</tool_call>`, `--tool-call-parser qwen25`, at the end of
this file); without one, "auto" is refused.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Collection, Dict, List, Optional, Tuple

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall, ToolChoice

logger = logging.getLogger("minisgl.tool_calls")

AUTO_NOT_BUILT = (
    'tool_choice "auto" (the default when tools are given) needs a parser for this model\'s own tool-call format: '
    "start the server with --tool-call-parser qwen25 for Qwen2.5/Qwen3 models (the only format minisgl parses), or "
    'use tool_choice "required" or {"type": "function", "function": {"name": ...}} (the call is then constrained '
    'to JSON), or "none"'
)


def validate_tools(request: ChatCompletionRequest, parser: Optional[str] = None) -> Optional[str]:
    """SGLang's messages for a tool_choice the tools cannot satisfy (sglang-facts.md §10.1), and
    minisgl's for "auto" without a --tool-call-parser; None when the request is fine."""
    choice = request.tool_choice
    if not request.tools and choice in (None, "none", "auto"):  # (nothing to call: a plain chat)
        return None
    if choice == "required" and not request.tools:
        return "Tools cannot be empty if tool choice is set to required."
    if isinstance(choice, ToolChoice):
        if not request.tools:
            return "Tools cannot be empty if tool choice is set to a specific tool."
        if all(tool.function.name != choice.function.name for tool in request.tools):
            return f"Tool '{choice.function.name}' not found in tools list."
    if choice in (None, "auto") and parser is None:
        return AUTO_NOT_BUILT
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
                    raise ValueError(f"Tool definition '{name}' has multiple schemas, which is not supported.")
                merged[name] = definition
        if merged:
            schema[section] = merged
    return json.dumps(schema)


def auto_call_constraint(request: ChatCompletionRequest) -> Optional[str]:
    """The structural tag (its JSON text) that constrains "auto" calls when a tool is strict, or None.

    SGLang's: the model writes free text, but from a `<tool_call>` trigger on, what follows is one
    of the tools' calls in Qwen's format, a strict tool's arguments matching its parameters (a
    tool that is not strict takes any JSON). Without a strict tool nothing is constrained."""
    if not request.tools or request.tool_choice not in (None, "auto") or not any(t.function.strict for t in request.tools):
        return None
    structures = [
        {
            # (the name as JSON: a `"` in it would have made the only allowed call invalid JSON)
            "begin": '<tool_call>\n{"name":' + json.dumps(tool.function.name, ensure_ascii=False) + ', "arguments":',
            "schema": (tool.function.parameters or {"type": "object", "properties": {}}) if tool.function.strict else {},
            "end": "}\n</tool_call>",
        }
        for tool in request.tools
    ]
    return json.dumps({"structures": structures, "triggers": [_QWEN_START]})


def visible_tools(request: ChatCompletionRequest) -> List[Tool]:
    """The tools the template shows and the call may use: all of them, or only the named one (SGLang's)."""
    choice = request.tool_choice
    if isinstance(choice, ToolChoice):
        return [t for t in request.tools or [] if t.function.name == choice.function.name][:1]
    return list(request.tools or [])


def parse_tool_calls(text: str) -> Optional[List[ToolCall]]:
    """The calls in a forced answer (a JSON array of {"name", "parameters"}), or None when the text is
    not one: an answer cut by max_tokens or a stop string is not a call, and is returned as content."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in calls):
        return None
    return [
        # (ensure_ascii off: "Zürich" as OpenAI and SGLang send it, not "Z\\u00fcrich")
        ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                 function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)))  # fmt: skip
        for c in calls
    ]


# --------------------------------------------------------------------------- tool_choice "auto"
# Model families' own tool-call formats (SGLang's --tool-call-parser). With "auto" nothing is
# constrained: the model writes text, calls in its format, or both, and the parser splits them.
_QWEN_START, _QWEN_END = "<tool_call>", "</tool_call>"
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_qwen25(text: str, tool_names: Collection[str]) -> Tuple[str, Optional[List[ToolCall]]]:
    """Qwen2.5 / Qwen3's format: (the text before the first `<tool_call>`, the calls), each call
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; (text, None) when there is
    none, or one is not such a JSON object (an answer cut inside a call stays text). A call of a
    function not in `tool_names` is dropped (SGLang's "Model attempted to call undefined
    function"): an agent must never be handed a function it did not offer; when every call is
    dropped, the answer is its text before the first block, with no calls (SGLang's too: the
    markup of a call that was dropped is not handed over as text either)."""
    start = text.find(_QWEN_START)
    if start < 0:
        return text, None
    calls: List[ToolCall] = []
    dropped = 0
    for body in _QWEN_CALL.findall(text[start:]):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, None
        if call["name"] not in tool_names:
            logger.warning("Model attempted to call undefined function: %s", call["name"])
            dropped += 1
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                              function=FunctionCall(name=call["name"], arguments=json.dumps(arguments, ensure_ascii=False))))  # fmt: skip
    if (not calls and not dropped) or _QWEN_CALL.sub("", text[start:]).strip():  # (text after or between the calls: not a call answer)
        return text, None
    # (SGLang strips both ends; the start is kept, as a stream has sent it by the time a call shows)
    return text[:start].rstrip(), calls or None


class StreamedText:
    """Splits a streamed answer of tool_choice "auto" into the content to send now and the tool
    calls held back: text that could be the start of `<tool_call>` waits until it is known, and
    so do blanks that may end the text before a call (the answer's content drops them), so that
    a stream sends exactly the non-streaming answer's content."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self.full = ""  # everything fed
        self.sent = ""  # what feed() gave out: always a prefix of the final content
        self.pending = ""  # held back: trailing blanks, then a suffix that may begin `<tool_call>`
        self.calls_text: Optional[str] = None  # from the first `<tool_call>` on

    def feed(self, delta: str) -> str:
        """The part of `delta` (with what was held back) that is content for sure."""
        self.full += delta
        if self.calls_text is not None:
            self.calls_text += delta
            return ""
        text = self.pending + delta
        start = text.find(_QWEN_START)
        if start >= 0:
            self.calls_text, self.pending = text[start:], text[:start]
            sure = text[:start].rstrip()
        else:
            held = next((k for k in range(min(len(_QWEN_START) - 1, len(text)), 0, -1) if _QWEN_START.startswith(text[-k:])), 0)
            sure = text[: len(text) - held].rstrip()
            self.pending = text[len(sure) :]
        self.sent += sure
        return sure

    def unsent(self) -> str:
        """Everything fed and not given out (an answer cut short: all of it is content)."""
        return self.full[len(self.sent) :]

    def finish(self) -> Tuple[str, Optional[List[ToolCall]]]:
        """At the end of the choice: (content still to send, the calls or None)."""
        content, calls = parse_qwen25(self.full, self.tool_names) if self.calls_text is not None else (self.full, None)
        return content[len(self.sent) :] if content.startswith(self.sent) else "", calls
