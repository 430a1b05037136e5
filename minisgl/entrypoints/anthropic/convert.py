"""Anthropic <-> chat translation (stage 1, the Anthropic Messages API). In: a checked MessagesRequest
(or CountTokensRequest). Out: the ChatCompletionRequest the chat path runs; and back, the chat
answer as an Anthropic `message` object (content blocks, stop_reason, usage).

The Messages API is a translation layer over the chat path, as SGLang's AnthropicServing
builds a ChatCompletionRequest: `system` becomes a system message first, user turns' text
blocks user messages and their `tool_result` blocks tool messages, assistant turns' text,
`thinking` and `tool_use` blocks one assistant message (content, reasoning_content,
tool_calls), custom tools chat's function tools, `tool_choice` chat's, `stop_sequences` stop,
`thinking` the chat template's `enable_thinking` (`thinking_template_kwargs`). Everything the
chat path checks (the model, the template, tool_choice against the tools, a grammar) it checks
here too, with its messages said in the Messages API's words (`anthropic_error`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from pydantic import ValidationError

from minisgl.entrypoints.anthropic.protocol import (
    BLOCK_SEPARATOR, BadMessagesRequest, Block, CountTokensRequest, Message, MessagesRequest, TextBlock, ThinkingBlock, Tool, ToolResultBlock,
    ToolUseBlock, check_cache_control, parse_block,
)  # fmt: skip
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponseChoice, UsageInfo, validation_message
from minisgl.entrypoints.openai.serving_base import reword

# a tool_result with is_error: the model reads that the call failed (chat's tool message has no flag for it)
TOOL_ERROR_PREFIX = "Error: "
# what a thinking block's `signature` holds: minisgl signs nothing (nothing checks a signature sent back)
SIGNATURE = ""


def tool_use_id(call_id: str) -> str:
    """A chat call's id (`call_<hex>`) as a tool_use block's (`toolu_<hex>`); a tool_result answers it by this id."""
    return "toolu_" + call_id[len("call_") :] if call_id.startswith("call_") else call_id


# --------------------------------------------------------------------------- thinking
def thinking_template_kwargs(request: CountTokensRequest, reasoning_parser: Optional[str], read: Optional[FrozenSet[str]]) -> Dict[str, Any]:
    """`thinking` as chat_template_kwargs; BadMessagesRequest for what the server cannot honour.

    `reasoning_parser`: the server's --reasoning-parser (None: it takes the model for one that does
    not think); `read`: the variables the chat template reads (None when unparsed: passed on, as chat does).
    - omitted: the model's own default (the template's), thinking returned when the parser finds it;
    - disabled: `enable_thinking: false` where the template has the switch; on a server without a
      reasoning parser there is no thinking to turn off; else refused (deepseek-r1 always thinks);
    - adaptive ("the model decides how much"): thinking on, as the model thinks;
    - enabled: the same, its `budget_tokens` enforced by `thinking_budget` (below)."""
    thinking = request.thinking
    if thinking is None:
        return {}
    switch = read is None or "enable_thinking" in read
    if thinking.display == "omitted":
        raise BadMessagesRequest('thinking.display "omitted" is not built: minisgl returns the thinking it parses; leave display out or send "summarized"')
    if thinking.type == "between_tools":
        raise BadMessagesRequest('thinking.type "between_tools" is not built; send "adaptive", "enabled" or "disabled"')
    if thinking.type == "disabled":
        if thinking.budget_tokens is not None:
            raise BadMessagesRequest('thinking.budget_tokens goes with thinking.type "enabled" only')
        if switch:
            return {"enable_thinking": False}
        if reasoning_parser is None:
            return {}
        raise BadMessagesRequest(
            f"thinking.type disabled cannot be honoured: this model thinks (--reasoning-parser {reasoning_parser}) and its chat template "
            "has no enable_thinking switch to turn it off; leave thinking out"
        )
    if reasoning_parser is None:
        raise BadMessagesRequest(
            f"thinking.type {thinking.type} needs a server started with --reasoning-parser (qwen3 or deepseek-r1), which returns the "
            "model's thinking as thinking blocks; this one does not separate it; leave thinking out"
        )
    if thinking.type == "adaptive":
        if thinking.budget_tokens is not None:
            raise BadMessagesRequest('thinking.budget_tokens goes with thinking.type "enabled" only; "adaptive" lets the model decide')
    elif thinking.budget_tokens is None:
        raise BadMessagesRequest('thinking.budget_tokens: Field required (thinking.type "enabled" takes a budget)')
    return {"enable_thinking": True} if switch and "enable_thinking" in (read or ()) else {}


def thinking_budget(request: CountTokensRequest, reasoning_parser: Optional[str], processors_enabled: bool, tokenizer: Any) -> Dict[str, Any]:
    """The chat request's fields that enforce thinking.budget_tokens (thinking "enabled"; {} otherwise):
    SGLang's built-in budget processor of the model family (`THINKING_BUDGET_PROCESSORS`, by
    --reasoning-parser) with custom_params {"thinking_budget": N}. BadMessagesRequest where it
    cannot run: a server without --enable-custom-logit-processor, a vocabulary whose think tokens
    are not the family's ids (the processor forces tokens by id). A budget is never ignored."""
    from minisgl.sampling.custom_logit_processor import THINKING_BUDGET_PROCESSORS

    thinking = request.thinking
    if thinking is None or thinking.type != "enabled" or thinking.budget_tokens is None:
        return {}
    budget = f"thinking.budget_tokens {thinking.budget_tokens}"
    if not processors_enabled:
        raise BadMessagesRequest(
            f"{budget} is enforced by a logit processor (SGLang's ThinkingBudgetLogitProcessor): start the server with "
            '--enable-custom-logit-processor, or send thinking {"type": "adaptive"} (the model decides how long it thinks)'
        )
    processor = THINKING_BUDGET_PROCESSORS.get(reasoning_parser or "")
    if processor is None:  # (thinking_template_kwargs refused "enabled" without a parser first)
        raise BadMessagesRequest(f"{budget} cannot be enforced: no thinking budget processor is built for --reasoning-parser {reasoning_parser}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<think>", "</think>")] + tokenizer.encode("\n", add_special_tokens=False)
    expected = [processor.THINKING_START_TOKEN_ID, processor.THINKING_END_TOKEN_ID, processor.NEW_LINE_TOKEN_ID]
    if ids != expected:
        raise BadMessagesRequest(
            f"{budget} cannot be enforced on this model: {processor.__name__} forces <think>, </think> and a newline by their ids "
            f'{expected}, and this tokenizer\'s are {ids}; send thinking {{"type": "adaptive"}}'
        )
    return {"custom_logit_processor": processor.to_str(), "custom_params": {"thinking_budget": thinking.budget_tokens}}


# --------------------------------------------------------------------------- the request
def to_chat_request(request: CountTokensRequest, rid: str, template_kwargs: Dict[str, Any], budget: Optional[Dict[str, Any]] = None) -> ChatCompletionRequest:
    """`request` as the chat request that runs it (count_tokens' too: its prompt is what it counts);
    `template_kwargs`: thinking_template_kwargs'; `budget`: thinking_budget's fields. BadMessagesRequest
    for what cannot be translated."""
    messages = _system(request) + _messages(request.messages)
    body: Dict[str, Any] = {"model": request.model, "messages": messages, "rid": rid, **(budget or {})}
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, stream=bool(request.stream))
        body.update({k: getattr(request, k) for k in ("temperature", "top_p", "top_k") if getattr(request, k) is not None})
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
    if request.messages[-1].role == "assistant":  # (a prefill: the answer goes on from it)
        body["continue_final_message"] = True
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    if request.tools:
        body["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
        names = [tool["function"]["name"] for tool in body["tools"]]
        if len(set(names)) < len(names):  # (Anthropic's 400: a call names its tool, which one would it be)
            twice = next(name for name in names if names.count(name) > 1)
            raise BadMessagesRequest(f"tools: Tool names must be unique: {twice!r} is declared more than once")
    if request.tool_choice is not None:
        body.update(_chat_tool_choice(request))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise BadMessagesRequest(anthropic_error(validation_message(e)[0])) from None


def _text(blocks: List[TextBlock]) -> str:
    return BLOCK_SEPARATOR.join(block.text for block in blocks)


def _system(request: CountTokensRequest) -> List[Dict[str, Any]]:
    if request.system is None:
        return []
    if isinstance(request.system, str):
        return [{"role": "system", "content": request.system}]
    blocks = [parse_block(block, f"system[{i}]", "system") for i, block in enumerate(request.system)]
    return [{"role": "system", "content": _text(blocks)}]  # type: ignore[arg-type]


def _turns(messages: List[Message]) -> List[Tuple[str, List[Block], str]]:
    """(role, its blocks, where the turn starts) per turn: consecutive messages of one role are one
    turn (Anthropic's rule), a string content one text block."""
    if not messages:
        raise BadMessagesRequest("messages is empty: send at least one message")
    turns: List[Tuple[str, List[Block], str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            blocks: List[Block] = [TextBlock(type="text", text=message.content)]
        elif not message.content:  # (Anthropic's rule; an empty final assistant message, a prefill of nothing, is left out instead)
            raise BadMessagesRequest(f"{where} is empty: a message holds at least one content block (leave out a message with nothing to say)")
        else:
            blocks = [parse_block(block, f"{where}[{j}]", message.role) for j, block in enumerate(message.content)]
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks, f"messages[{i}]"))
    return turns


def _messages(messages: List[Message]) -> List[Dict[str, Any]]:
    """The turns as chat messages. A user turn's tool_result blocks must answer every tool_use of
    the assistant turn right before it (Anthropic's rule: else the template would show a call with
    no result), each becoming a tool message; its text blocks a user message after them."""
    chat: List[Dict[str, Any]] = []
    unanswered: List[str] = []  # the last assistant turn's tool_use ids
    turns = _turns(messages)
    for k, (role, blocks, where) in enumerate(turns):
        if role == "system":
            chat.append({"role": "system", "content": _text(blocks)})  # type: ignore[arg-type]
        elif role == "assistant":
            if unanswered:
                raise _no_result(unanswered, where)
            chat.append(_assistant(blocks, where, last=k == len(turns) - 1))
            unanswered = [block.id for block in blocks if isinstance(block, ToolUseBlock)]
        else:
            texts: List[TextBlock] = []
            for block in blocks:
                if isinstance(block, ToolResultBlock):
                    if block.tool_use_id not in unanswered:
                        raise BadMessagesRequest(
                            f"{where}: tool_result tool_use_id {block.tool_use_id!r} answers no tool_use of the assistant message right "
                            "before it (each tool_result answers a tool_use of the previous turn, once)"
                        )
                    unanswered.remove(block.tool_use_id)
                    text = TOOL_ERROR_PREFIX + block.text() if block.is_error else block.text()
                    chat.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
                else:
                    texts.append(block)  # type: ignore[arg-type]
            if unanswered:
                raise _no_result(unanswered, where)
            if texts:
                chat.append({"role": "user", "content": _text(texts)})
    if unanswered and turns[-1][0] == "assistant":
        raise BadMessagesRequest(f"{turns[-1][2]}: a final assistant message (a prefill the answer goes on from) may hold only text; "
                                 "its tool_use blocks need their tool_result in a user message after it")  # fmt: skip
    return chat


def _no_result(unanswered: List[str], where: str) -> BadMessagesRequest:
    """Anthropic's 400 for calls whose results never came."""
    return BadMessagesRequest(
        f"{where}: tool_use ids were found without tool_result blocks immediately after: {', '.join(unanswered)}. Each tool_use block "
        "must have a corresponding tool_result block in the next message"
    )


def _assistant(blocks: List[Block], where: str, last: bool) -> Dict[str, Any]:
    texts = [b for b in blocks if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]  # fmt: skip
    if last and thinking and not texts and not calls:
        raise BadMessagesRequest(f"{where}: a final assistant message (a prefill) of thinking only cannot be continued; add its text, or drop it")
    message: Dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts or not calls else None}  # type: ignore[arg-type]
    if calls:
        message["tool_calls"] = calls
    if thinking:  # (the template decides whether the model sees it, as chat's reasoning_content)
        message["reasoning_content"] = "".join(thinking)
    return message


def _chat_tool(tool: Dict[str, Any], where: str) -> Dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise BadMessagesRequest(
            f"{where}: {kind!r} tools are not supported by minisgl: it runs no server tools (web search, web fetch, bash, text editor, "
            "code execution, computer use, memory, tool search, ...); declare a custom tool (name, description, input_schema) and run it yourself"
        )
    try:
        parsed = Tool.model_validate(tool)
    except ValidationError as e:
        raise BadMessagesRequest(validation_message(e, where)[0]) from None
    check_cache_control(parsed.cache_control, f"{where}.cache_control")
    _check_tool_options(parsed, where)
    if parsed.input_schema.get("type") != "object":
        raise BadMessagesRequest(f'{where}.input_schema: a tool\'s input is an object: its schema\'s type must be "object" (Anthropic\'s rule)')
    function = {"name": parsed.name, "parameters": parsed.input_schema, "description": parsed.description, "strict": parsed.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _check_tool_options(tool: Tool, where: str) -> None:
    """A custom tool's options: what minisgl does is accepted, the rest a 400 that says why."""
    if tool.eager_input_streaming:
        raise BadMessagesRequest(
            f"{where}.eager_input_streaming: true is not supported: minisgl holds a streamed call's input until the answer's end (only the end "
            "says whether it is a call: docs/server.md), as false asks; leave it out or send false"
        )
    if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
        raise BadMessagesRequest(f"{where}.allowed_callers: minisgl's only caller is the model itself (\"direct\"): it runs no code execution "
                                 'that could call the tool; send ["direct"] or leave it out')  # fmt: skip
    if tool.defer_loading:
        raise BadMessagesRequest(f"{where}.defer_loading: tool search is not supported by minisgl: every tool is in the prompt; leave it out or send false")
    if tool.input_examples:
        raise BadMessagesRequest(f"{where}.input_examples are not supported by minisgl (the chat template has no place for them); "
                                 "put examples in the description")  # fmt: skip


def _chat_tool_choice(request: CountTokensRequest) -> Dict[str, Any]:
    choice = request.tool_choice
    assert choice is not None
    if (choice.type == "tool") != (choice.name is not None):
        raise BadMessagesRequest('tool_choice.name: a {"type": "tool"} choice names its tool, and only it does')
    if choice.type == "none" and choice.disable_parallel_tool_use is not None:
        raise BadMessagesRequest('tool_choice.disable_parallel_tool_use goes with "auto", "any" or "tool" (with "none" there are no calls)')
    fields: Dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


# chat's words -> the Messages API's, in the messages of the chat path's errors
_ERROR_WORDS = [
    (re.compile(r'tool_choice "auto" \(the default when tools are given\)'), 'tool_choice {"type": "auto"} (the default when tools are given)'),
    (re.compile(r'or use tool_choice "required" or \{"type": "function", "function": \{"name": \.\.\.\}\}'),
     'or use tool_choice {"type": "any"} or {"type": "tool", "name": ...}'),
    (re.compile(r'\(the call is then constrained to JSON\), or "none"'), '(the call is then constrained to JSON), or {"type": "none"}'),
    (re.compile(r'tool_choice "required"'), 'tool_choice {"type": "any"}'),
    (re.compile(r"tool choice is set to required"), 'tool_choice is {"type": "any"}'),
    (re.compile(r"an assistant message's tool_calls is"), "tool_use blocks (an assistant message's tool_calls) are"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
]


def anthropic_error(message: str) -> str:
    """An error message of the chat path in the Messages API's words (its fields by their names here)."""
    return reword(message, _ERROR_WORDS)


# --------------------------------------------------------------------------- the answer
def stop_reason(finish_reason: Optional[str], matched: Any, stop_sequences: Optional[List[str]]) -> Tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a chat finish: a matched stop string is a stop_sequence, any
    other stop (the EOS) end_turn, tool_calls tool_use, length max_tokens."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish_reason or "stop", "end_turn"), None


def usage_object(usage: UsageInfo) -> Dict[str, int]:
    """Anthropic's usage, whose three input counts add up to the prompt: cache_read_input_tokens the
    radix hit, input_tokens the rest (what this request computed), cache_creation_input_tokens 0:
    the radix tree keeps every computed token, counted once, in input_tokens (docs/server.md)."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}  # fmt: skip


def content_blocks(choice: ChatCompletionResponseChoice) -> List[Dict[str, Any]]:
    """A chat choice as content blocks: its thinking, its text, its calls (none of an empty answer)."""
    message = choice.message
    blocks: List[Dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": SIGNATURE})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name, "input": json.loads(call.function.arguments)})
    return blocks


def partial_input(text: str) -> Dict[str, Any]:
    """A call's arguments cut short (max_tokens) as the object they hold so far, read as the SDK's
    stream helper reads a tool_use block's input_json_delta pieces (jiter's partial mode): its
    complete members, an unfinished string, key or literal left out; {} when none is complete.
    The longest prefix that ends outside a string and closes into JSON (its open brackets
    closed, a trailing comma dropped) wins."""
    stack: List[str] = []
    outside: List[Tuple[int, str]] = [(0, "")]  # (prefix length, its closers) where no string is open
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
        if not in_string:
            outside.append((i + 1, "".join(reversed(stack))))
    for end, closers in reversed(outside):
        try:
            value = json.loads(text[:end].rstrip().rstrip(",") + closers)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def message_object(message_id: str, model: str, content: List[Dict[str, Any]], reason: Optional[str], sequence: Optional[str],
                   usage: Dict[str, int]) -> Dict[str, Any]:  # fmt: skip
    """The message as the SDK types it (anthropic.types.Message)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}  # fmt: skip

