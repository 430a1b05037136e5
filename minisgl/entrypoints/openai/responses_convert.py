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

import json
import re
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

from pydantic import ValidationError

from minisgl.entrypoints.openai.protocol import (
    ChatChoiceLogprobs, ChatCompletionRequest, ChatCompletionResponseChoice, ChatTokenLogprob, validation_message,
)  # fmt: skip
from minisgl.entrypoints.openai.responses_protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionTool, InputItem, MessageItem, ReasoningItem, ResponsesRequest, parse_item,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_base import new_id, reword
from minisgl.entrypoints.openai.tool_parsers import NOT_JSON


class BadResponsesRequest(ValueError):
    """A request the translation cannot run: a 400 whose `param` names the Responses field."""

    def __init__(self, message: str, param: Optional[str]) -> None:
        super().__init__(message)
        self.param = param


# chat's field -> the Responses field it came from (so that chat's errors name what the client sent;
# a field of the same name in both is not listed)
_CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort"}  # fmt: skip
_SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "seed")


# chat's words for the fields -> the Responses', in a message's text (the words only: the param
# comes from the error's own param, never from its text)
_ERROR_WORDS = [
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"an assistant message's tool_calls is"), "function_call items (an assistant message's tool_calls) are"),
]


def responses_error(message: str, param: Optional[str]) -> Tuple[str, Optional[str]]:
    """An error of the chat path (its message, its param: chat's field, as the chat route's error
    body names it, or None) as the Responses route says it: the param by _CHAT_TO_RESPONSES, the
    fields in the text by _ERROR_WORDS."""
    if param is not None:
        head = re.split(r"[.\[]", param, maxsplit=1)[0]
        param = _CHAT_TO_RESPONSES.get(head, head) + param[len(head) :]
        if param.startswith("text.format.json_schema"):  # (chat nests what text.format holds flat)
            param = "text.format" + param[len("text.format.json_schema") :]
    message = reword(message, _ERROR_WORDS)
    message = message.replace("response_format.json_schema", "text.format").replace("text.format.json_schema", "text.format")
    return message, param


class Translated(NamedTuple):
    chat: ChatCompletionRequest
    conversation: List[Dict[str, Any]]  # the earlier turns and this input, as chat messages (no instructions)
    input_items: List[Dict[str, Any]]  # this request's input as items with ids (what GET .../input_items lists)


def to_chat_request(request: ResponsesRequest, rid: str, earlier: List[Dict[str, Any]]) -> Translated:
    """`request` as the chat request that runs it; `earlier`: the conversation of the response it
    continues (previous_response_id), else []. BadResponsesRequest for what cannot be translated."""
    items = _input_items(request)
    conversation = list(earlier) + _messages(items, earlier)
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
        message, field = validation_message(e)
        raise BadResponsesRequest(*responses_error(message, field or None)) from None
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


def _messages(items: List[InputItem], earlier: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Input items as chat messages, after the `earlier` turns. A function_call joins the assistant
    message right before it (the calls of one turn are one message); a reasoning item's text goes
    with the assistant turn after it; a function_call_output must answer a call made earlier (here
    or in the stored turns), and every call must have its output before the next message."""
    messages: List[Dict[str, Any]] = []
    reasoning: Optional[Tuple[int, str]] = None  # (its item's index, its text), until its turn comes
    joinable = False  # whether the last message is an assistant turn the next function_call joins
    calls = _call_ids(earlier)
    answered = {m.get("tool_call_id") for m in earlier if m.get("role") == "tool"}
    unanswered = [call["id"] for m in earlier for call in m.get("tool_calls") or [] if call["id"] not in answered]
    for i, item in enumerate(items):
        if reasoning is not None and not (isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")):
            raise _misplaced_reasoning(reasoning[0])
        if isinstance(item, ReasoningItem):
            reasoning = (i, item.text())
            continue
        if isinstance(item, MessageItem):
            if unanswered:
                raise _no_output(unanswered)
            content: Any = item.content if isinstance(item.content, str) else [{"type": "text", "text": p.text} for p in item.content]
            messages.append({"role": item.role, "content": content})
            joinable = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except NOT_JSON:
                raise BadResponsesRequest(f"input[{i}].arguments must be JSON text (the call's arguments object), got {item.arguments!r}",
                                          f"input[{i}].arguments") from None  # fmt: skip
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not joinable:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
            unanswered.append(item.call_id)
            joinable = True
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise BadResponsesRequest(
                    f"input[{i}]: function_call_output call_id {item.call_id!r} answers no function_call: send the function_call item "
                    "before it, or continue the response that made the call with previous_response_id",
                    "input",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            unanswered = [c for c in unanswered if c != item.call_id]
            joinable = False
        if reasoning is not None:  # (this item is the assistant turn it led to)
            messages[-1]["reasoning_content"] = reasoning[1]
            reasoning = None
    if reasoning is not None:
        raise _misplaced_reasoning(reasoning[0])
    if unanswered:
        raise _no_output(unanswered)
    return messages


def _misplaced_reasoning(index: int) -> BadResponsesRequest:
    return BadResponsesRequest(f"input[{index}]: a reasoning item goes right before the assistant message or function_call it led to", "input")


def _no_output(unanswered: List[str]) -> BadResponsesRequest:
    """OpenAI's error for a call whose result never came (a chat template would show a call without its result)."""
    return BadResponsesRequest(
        f"No tool output found for function call {unanswered[0]}: send a function_call_output item with call_id "
        f"{unanswered[0]!r} right after the call(s), before any message",
        "input",
    )


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
        raise BadResponsesRequest(validation_message(e, where)[0], "tools") from None
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
        for field in ("name", "schema"):  # (both required, as OpenAI's)
            if field not in fmt:
                raise BadResponsesRequest(f"text.format.{field}: Field required (a json_schema format has a name and a schema)", f"text.format.{field}")
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


def cut(finish_reason: Optional[str]) -> bool:
    """Whether a finish cut the answer short: max_output_tokens reached ("length") or an abort. Its
    last item is then "incomplete", and so is every call (the chat path takes a cut answer's calls
    back: their text is the message's); the items before it were completed."""
    return finish_reason in ("length", "abort")


def output_items(choice: ChatCompletionResponseChoice, answer_tokens: Optional[List[ChatTokenLogprob]]) -> List[Dict[str, Any]]:
    """A chat choice as output items: its reasoning, its message, its calls. A message is there
    whenever there is text, or nothing else (an empty answer is an empty message, as a stream ends).
    `answer_tokens`: the logprobs of the answer's tokens (not the reasoning's), None when not asked."""
    status = "incomplete" if cut(choice.finish_reason) else "completed"
    message = choice.message
    items: List[Dict[str, Any]] = []
    if message.reasoning_content:
        # (cut while it thought: no answer came after it)
        thought = "completed" if message.content or message.tool_calls else status
        items.append(reasoning_item(new_id("rs"), [{"type": "reasoning_text", "text": message.reasoning_content}], thought))
    if message.content or not message.tool_calls:
        logprobs = [_logprob(t) for t in answer_tokens] if answer_tokens is not None else None
        items.append(message_item(new_id("msg"), [text_part(message.content or "", logprobs)], status))
    for call in message.tool_calls or []:
        items.append(call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, status))
    return items


def reasoning_text(output: List[Dict[str, Any]]) -> str:
    """The text of a response's reasoning items."""
    return "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])


def _continuable(item: Dict[str, Any]) -> bool:
    """Whether a function_call item can go into a next turn: a whole call, its arguments JSON (a
    chat template reads them as an object). A cut one cannot: its text is in the message already."""
    if item["status"] == "incomplete":
        return False
    try:
        json.loads(item["arguments"])
    except NOT_JSON:
        return False
    return True


def output_as_message(output: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A response's output as the assistant turn of a chat conversation (what a next turn continues):
    its text, its reasoning and its whole calls (a cut call's text is the message's, as the chat path
    answers a cut answer with its text and no calls)."""
    reasoning = reasoning_text(output)
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and _continuable(item)]  # fmt: skip
    message: Dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
