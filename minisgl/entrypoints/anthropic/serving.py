"""AnthropicServing (stage 1, the Anthropic Messages API). In: MessagesRequest, CountTokensRequest.
Out: a `message` object, or its stream of events; {"input_tokens": N}.

A translation layer over the chat path, as SGLang's AnthropicServing (entrypoints/anthropic/serving.py):
the request becomes a ChatCompletionRequest (convert.py), which the chat route's own checks
(`precheck`), conversion (`to_generate_request`: the template, a tool call's grammar) and
generation run; the chat answer becomes content blocks. A stream drives the chat path's
`stream_deltas`, whose ChatDeltas StreamedBlocks (stream.py) turns into Anthropic's events, each an
SSE `event:` + `data:` pair:

    message_start, <the blocks' events>, message_delta (stop_reason, usage), message_stop
    (an error after the headers: an `error` event ends the stream)

Errors are Anthropic's: {"type": "error", "error": {"type": "invalid_request_error", "message"}}.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.chat_template import template_variables
from minisgl.entrypoints.anthropic.convert import (
    anthropic_error, content_blocks, message_object, stop_reason, thinking_budget, thinking_template_kwargs, to_chat_request,
    usage_object,
)  # fmt: skip
from minisgl.entrypoints.anthropic.protocol import BadMessagesRequest, CountTokensRequest, MessagesRequest, refusal
from minisgl.entrypoints.anthropic.stream import StreamedBlocks, folded
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest
from minisgl.entrypoints.openai.serving_base import (
    ABORTED, StreamedHiddenStates, UsageCounter, collect_outputs, encodable, guarded_stream, handler_error_response, new_id,
    openai_error_message, sse_event, sse_response, start_stream,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat

# HTTP status -> Anthropic's error type (anthropic.types.shared.ErrorType); 503 (minisgl's full queue) is overloaded_error
# (only the statuses these routes answer with; any other 4xx is invalid_request_error, 5xx api_error)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}


def anthropic_error_body(message: str, status_code: int = 400) -> Dict[str, Any]:
    """Anthropic's error envelope (anthropic.types.ErrorResponse)."""
    kind = _ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": encodable(message)}}


def anthropic_error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status_code), status_code=status_code)


def from_openai_error(response: JSONResponse) -> JSONResponse:
    """A chat-path error response (OpenAI's envelope) as the Messages API says it."""
    return anthropic_error_response(anthropic_error(openai_error_message(response)), response.status_code)


def _event(kind: str, **fields: Any) -> str:
    """One SSE event as Anthropic frames them: its type as the event name, then its data."""
    return sse_event(kind, {"type": kind, **fields})


def _error_events(message: str, status_code: int, param: Optional[str] = None) -> List[str]:
    # (param unused: Anthropic's error envelope names no field)
    return [_event("error", **{k: v for k, v in anthropic_error_body(message, status_code).items() if k != "type"})]


async def _nothing() -> AsyncIterator[Dict[str, Any]]:
    """An output stream with no more outputs (the whole answer came first)."""
    return
    yield


class AnthropicServing:
    """POST /v1/messages and /v1/messages/count_tokens over the chat path (`serving_chat`'s public methods)."""

    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        self.chat = serving_chat
        self.tokenizer_manager = serving_chat.tokenizer_manager

    def _translate(self, request: CountTokensRequest) -> Union[ChatCompletionRequest, JSONResponse]:
        """The chat request that runs `request`, or the error response that says why there is none."""
        refused = refusal(request)
        if refused is not None:
            return anthropic_error_response(f"{refused[1]}: {refused[0]}")
        read = template_variables(getattr(self.chat.tokenizer, "chat_template", None))
        try:
            args = self.tokenizer_manager.server_args
            kwargs = thinking_template_kwargs(request, args.reasoning_parser, read)
            budget = thinking_budget(request, args.reasoning_parser, args.enable_custom_logit_processor, self.chat.tokenizer)
            chat = to_chat_request(request, new_id("msg"), kwargs, budget)
        except BadMessagesRequest as e:
            return anthropic_error_response(str(e))
        refused_chat = self.chat.precheck(chat)  # (the chat route's checks: the model, LoRA, tools, ...)
        return from_openai_error(refused_chat) if refused_chat is not None else chat

    # --- POST /v1/messages
    async def handle_messages(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat = self._translate(request)
        if isinstance(chat, JSONResponse):
            return chat
        try:
            adapted = self.chat.to_generate_request(chat)
            if request.stream:
                first, gen = await start_stream(self.tokenizer_manager, adapted, raw_request)
                return sse_response(guarded_stream(self._stream_events(first, gen, chat, request), gen, _error_events))
            outs = await collect_outputs(self.tokenizer_manager, adapted, raw_request)
        except Exception as e:
            return from_openai_error(handler_error_response(e))
        choice = self.chat.chat_response(outs, chat).choices[0]
        if choice.finish_reason == "abort":  # (aborted without a status: no stop_reason says it)
            return anthropic_error_response(ABORTED, 500)
        usage = UsageCounter(1)
        usage.update(0, outs[0]["meta_info"])
        reason, sequence = stop_reason(choice.finish_reason, choice.matched_stop, request.stop_sequences)
        content = content_blocks(choice)
        if choice.finish_reason == "length" and chat.tools and chat.tool_choice != "none":
            # (cut by max_tokens where a call may have begun: the chat answer holds its markup as
            # text, a stream a tool_use block of its partial input; both give the stream's)
            content = await self._streamed_content(outs[0], chat)
        return JSONResponse(message_object(str(chat.rid), request.model, content, reason, sequence, usage_object(usage.usage())))

    async def _streamed_content(self, out: Dict[str, Any], chat: ChatCompletionRequest) -> List[Dict[str, Any]]:
        """The content blocks a stream of `out` (the whole answer, as one piece) adds up to."""
        blocks, events = StreamedBlocks(), []
        async for d in self.chat.stream_deltas(out, _nothing(), chat, UsageCounter(1), StreamedHiddenStates()):
            events += blocks.feed(d)
        return folded(events)

    async def _stream_events(self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], chat: ChatCompletionRequest,
                             request: MessagesRequest) -> AsyncIterator[str]:  # fmt: skip
        usage, blocks, started = UsageCounter(1), StreamedBlocks(), False
        async for d in self.chat.stream_deltas(first, rest, chat, usage, StreamedHiddenStates()):
            if d.refused is not None:  # (an abort with a status, e.g. the queue is full)
                for event in _error_events(d.refused.get("message") or "Aborted", int(d.refused["status_code"])):
                    yield event
                return
            if not started:  # (the role delta: the prompt's usage is known)
                started = True
                yield _event("message_start", message=message_object(str(chat.rid), request.model, [], None, None, usage_object(usage.usage())))
            for kind, fields in blocks.feed(d):
                yield _event(kind, **fields)
        if blocks.finish_reason == "abort":
            for event in _error_events(ABORTED, 500):
                yield event
            return
        reason, sequence = stop_reason(blocks.finish_reason, blocks.matched, request.stop_sequences)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage_object(usage.usage()))
        yield _event("message_stop")

    # --- POST /v1/messages/count_tokens
    def count_tokens(self, request: CountTokensRequest) -> Response:
        """The tokens of the prompt the chat template renders (what a create's input tokens add up to)."""
        chat = self._translate(request)
        if isinstance(chat, JSONResponse):
            return chat
        try:
            prompt = self.chat.to_generate_request(chat).text
        except Exception as e:
            return from_openai_error(handler_error_response(e))
        assert isinstance(prompt, str)
        return JSONResponse({"input_tokens": len(self.chat.tokenizer.encode(prompt, add_special_tokens=False))})
