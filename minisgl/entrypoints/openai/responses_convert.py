"""Responses <-> chat translation (stage 1, the Responses API). In: a ResponsesRequest (and the
stored response it continues). Out: the ChatCompletionRequest the chat path runs; and back, the
chat answer as Responses output items.

The Responses API is a translation layer over the chat path (as SGLang's OpenAIServingResponses
builds a ChatCompletionRequest): input items become chat messages, `instructions` a system
message first, function tools and tool_choice chat's nested shapes, `text.format` chat's
response_format, `reasoning.effort` reasoning_effort, `max_output_tokens`
max_completion_tokens. Everything the chat path checks (the chat template, tool_choice against
the tools, a grammar) it checks here too, with the same messages.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

from pydantic import ValidationError

from minisgl.entrypoints.openai.protocol import ChatChoiceLogprobs, ChatCompletionRequest, ChatCompletionResponseChoice, ChatTokenLogprob
from minisgl.entrypoints.openai.responses_protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionTool, InputItem, MessageItem, ReasoningItem, ResponsesRequest, parse_item,
)  # fmt: skip


class BadResponsesRequest(ValueError):
    """A request the translation cannot run: a 400 whose `param` names the Responses field."""

    def __init__(self, message: str, param: Optional[str]) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_..., msg_..., rs_..., fc_... (a prefix and 32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# chat's field -> the Responses field it came from (so that chat's errors name what the client sent)
_CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort", "top_logprobs": "top_logprobs"}  # fmt: skip
_SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "seed")


class Translated(NamedTuple):
    chat: ChatCompletionRequest
    conversation: List[Dict[str, Any]]  # the earlier turns and this input, as chat messages (no instructions)
    input_items: List[Dict[str, Any]]  # this request's input as items with ids (what GET .../input_items lists)


def to_chat_request(request: ResponsesRequest, rid: str, earlier: List[Dict[str, Any]]) -> Translated:
    """`request` as the chat request that runs it; `earlier`: the conversation of the response it
    continues (previous_response_id), else []. BadResponsesRequest for what cannot be translated."""
    items = _input_items(request)
    conversation = list(earlier) + _messages(items, _call_ids(earlier))
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions is not None else []) + conversation
    body: Dict[str, Any] = {"model": request.model, "messages": messages, "stream": bool(request.stream), "rid": rid}
    body.update({k: getattr(request, k) for k in _SAMPLING_KNOBS if getattr(request, k) is not None})
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.logprobs:
        body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        body["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.text is not None and request.text.format is not None:
        body["response_format"] = _chat_response_format(request.text.format)
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        param = _CHAT_TO_RESPONSES.get(loc[0], loc[0]) if loc else None
        where = ".".join([param or ""] + loc[1:]) if loc else "the request"
        raise BadResponsesRequest(f"{where}: {first.get('msg')}", param) from None
    return Translated(chat, conversation, [_listed(item) for item in items])


def _input_items(request: ResponsesRequest) -> List[InputItem]:
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    if not request.input:
        raise BadResponsesRequest("input is empty: send a string or a list of at least one item", "input")
    try:
        return [parse_item(item, f"input[{i}]") for i, item in enumerate(request.input)]
    except ValueError as e:
        raise BadResponsesRequest(str(e), "input") from None


def _call_ids(messages: List[Dict[str, Any]]) -> Set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or []}


def _messages(items: List[InputItem], calls: Set[str]) -> List[Dict[str, Any]]:
    """Input items as chat messages. A function_call joins the assistant message right before it
    (the calls of one turn are one message); a reasoning item's text goes with the assistant turn
    after it; a function_call_output must answer a call made earlier (here or in the stored turns)."""
    messages: List[Dict[str, Any]] = []
    reasoning: Optional[Tuple[int, str]] = None  # (its item's index, its text), until its turn comes
    joinable = False  # whether the last message is an assistant turn the next function_call joins
    calls = set(calls)
    for i, item in enumerate(items):
        if reasoning is not None and not (isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")):
            raise BadResponsesRequest(f"input[{reasoning[0]}]: a reasoning item goes right before the assistant message or function_call it led to", "input")
        if isinstance(item, ReasoningItem):
            reasoning = (i, item.text())
            continue
        if isinstance(item, MessageItem):
            content: Any = item.content if isinstance(item.content, str) else [{"type": "text", "text": p.text} for p in item.content]
            messages.append({"role": item.role, "content": content})
            joinable = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not joinable:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
            joinable = True
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise BadResponsesRequest(
                    f"input[{i}]: function_call_output call_id {item.call_id!r} answers no function_call: send the function_call item "
                    "before it, or continue the response that made the call with previous_response_id",
                    "input",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            joinable = False
        if reasoning is not None:  # (this item is the assistant turn it led to)
            messages[-1]["reasoning_content"] = reasoning[1]
            reasoning = None
    if reasoning is not None:
        raise BadResponsesRequest(f"input[{reasoning[0]}]: a reasoning item goes right before the assistant message or function_call it led to", "input")
    return messages


def _listed(item: InputItem) -> Dict[str, Any]:
    """An input item as GET .../input_items lists it: with an id (the client's, else a new one) and a status."""
    if isinstance(item, MessageItem):
        part = "output_text" if item.role == "assistant" else "input_text"
        texts = [item.content] if isinstance(item.content, str) else [p.text for p in item.content]
        content = [{"type": part, "text": t, **({"annotations": []} if part == "output_text" else {})} for t in texts]
        return {"id": item.id or new_id("msg"), "type": "message", "role": item.role, "content": content, "status": "completed"}
    listed = item.model_dump(exclude_none=True)
    prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[listed["type"]]
    return {**listed, "id": item.id or new_id(prefix), "status": "completed"}


def _chat_tool(tool: Dict[str, Any], where: str) -> Dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise BadResponsesRequest(
            f"{where}: {kind!r} tools are not supported by minisgl: it runs no built-in tools (web search, file search, code "
            'interpreter, computer use, MCP, ...); declare a function tool (type "function") and run it yourself',
            "tools",
        )
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as e:
        first = e.errors()[0]
        raise BadResponsesRequest(f"{where}.{'.'.join(str(x) for x in first.get('loc', ()))}: {first.get('msg')}", "tools") from None
    return {"type": "function", "function": function.model_dump(exclude={"type"}, exclude_none=True)}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"} and isinstance(choice["name"], str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadResponsesRequest(
        f'tool_choice {choice!r} is not supported by minisgl: send "none", "auto", "required" or {{"type": "function", "name": ...}} '
        "(allowed_tools and built-in tools' choices are not built)",
        "tool_choice",
    )


def _chat_response_format(fmt: Dict[str, Any]) -> Dict[str, Any]:
    """text.format (flat: {"type": "json_schema", "name", "schema", ...}) as chat's response_format."""
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema" and set(fmt) <= {"type", "name", "schema", "description", "strict"}:
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise BadResponsesRequest(
        f"text.format {fmt!r} is not supported: send {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
        '{"type": "json_schema", "name": ..., "schema": {...}} (with description and strict if you like)',
        "text.format",
    )


# --------------------------------------------------------------------------- output items
def output_logprobs(logprobs: Optional[ChatChoiceLogprobs]) -> List[Dict[str, Any]]:
    """Chat's token logprobs as output_text's (token, bytes, logprob, top_logprobs)."""
    return [_logprob(t) for t in (logprobs.content or [])] if logprobs is not None else []


def _logprob(t: ChatTokenLogprob) -> Dict[str, Any]:
    tops = [{"token": top.token, "bytes": top.bytes or [], "logprob": top.logprob} for top in t.top_logprobs]
    return {"token": t.token, "bytes": t.bytes or [], "logprob": t.logprob, "top_logprobs": tops}


def text_part(text: str, logprobs: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """An output_text part; `logprobs` None when the request did not include them."""
    part: Dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, parts: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def reasoning_item(item_id: str, parts: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def output_items(choice: ChatCompletionResponseChoice, with_logprobs: bool) -> List[Dict[str, Any]]:
    """A chat choice as output items: its reasoning, its message, its calls. A message is there
    whenever there is text, or nothing else (an empty answer is an empty message, as a stream ends)."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    message = choice.message
    items: List[Dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(new_id("rs"), [{"type": "reasoning_text", "text": message.reasoning_content}], status))
    if message.content or not message.tool_calls:
        logprobs = output_logprobs(choice.logprobs) if with_logprobs else None
        items.append(message_item(new_id("msg"), [text_part(message.content or "", logprobs)], status))
    for call in message.tool_calls or []:
        items.append(call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, "completed"))
    return items


def output_as_message(output: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A response's output as the assistant turn of a chat conversation (what a next turn continues)."""
    reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]  # fmt: skip
    message: Dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
