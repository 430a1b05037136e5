"""Forced tool calls (stage 1, chat only): `tool_choice` "required" or a named function.

Where it sits: OpenAIServingChat turns the request's `tools` + `tool_choice` into a JSON
schema (`tool_call_constraint`), which goes down as the request's `json_schema` sampling
key: structured output (docs/structured_output.md) then makes the model write a JSON array
of calls, `[{"name": ..., "parameters": {...}}, ...]`, whatever the model. When the answer
comes back, `parse_tool_calls` turns that array into OpenAI's `tool_calls`.

This is SGLang's path for these two choices (its `get_json_schema_constraint` and
`JsonArrayParser`, which bypass the model-specific parsers). `tool_choice: "auto"` needs
what minisgl does not have: a parser for each model family's own tool-call format
(`<tool_call>...</tool_call>` for Qwen, `[TOOL_CALLS]` for Mistral, ...), so it is refused.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall, ToolChoice

AUTO_NOT_BUILT = (
    'tool_choice "auto" (the default when tools are given) needs a parser for this model\'s own tool-call format, '
    'which minisgl does not have: use tool_choice "required" or {"type": "function", "function": {"name": ...}} '
    '(the call is then constrained to JSON), or "none"'
)


def validate_tools(request: ChatCompletionRequest) -> Optional[str]:
    """SGLang's messages for a tool_choice the tools cannot satisfy (sglang-facts.md §10.1), and
    minisgl's for "auto"; None when the request is fine."""
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
    if choice in (None, "auto"):
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
    forced (no tools, or tool_choice "none"). SGLang's shape: an array of at least one call, of
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
