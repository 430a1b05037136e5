"""OpenAIServingResponses (stage 1, the Responses API). In: ResponsesRequest. Out: a `response`
object, or its stream of events; and the stored responses (GET, DELETE, input_items).

A translation layer over the chat path, as SGLang's OpenAIServingResponses: the request becomes a
ChatCompletionRequest (responses_convert.py), which the chat route's own checks, conversion and
generation run; the chat answer becomes output items. A stream drives the chat path's
`stream_deltas`, whose ChatDeltas StreamedOutput (responses_stream.py) turns into the Responses
events, each an SSE `event:` + `data:` pair numbered by `sequence_number`:

    response.created, response.in_progress, <the items' events>, response.completed | response.incomplete
    (an error after the headers: an `error` event ends the stream)

With `store` (the default) the finished response, its input items and its conversation go to
the ResponseStore, which `previous_response_id` continues from.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo
from minisgl.entrypoints.openai.response_store import ResponseStore, StoredResponse
from minisgl.entrypoints.openai.responses_convert import (
    BadResponsesRequest, new_id, output_as_message, output_items, to_chat_request,
)  # fmt: skip
from minisgl.entrypoints.openai.responses_protocol import ResponsesRequest, refusal
from minisgl.entrypoints.openai.responses_stream import StreamedOutput
from minisgl.entrypoints.openai.serving_base import (
    OpenAIServingBase, StreamedHiddenStates, UsageCounter, create_error_response,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat
from minisgl.managers.io_struct import GenerateReqInput

INPUT_ITEMS_MAX_LIMIT = 100  # OpenAI's bounds of GET .../input_items?limit= (default 20)


class ResponsesTurn:
    """One POST /v1/responses on its way: the request, the chat request it became, and what the
    response object echoes and the store keeps."""

    def __init__(self, request: ResponsesRequest, chat: ChatCompletionRequest, response_id: str,
                 conversation: List[Dict[str, Any]], input_items: List[Dict[str, Any]]) -> None:  # fmt: skip
        self.request = request
        self.chat = chat
        self.id = response_id
        self.created_at = int(time.time())
        self.conversation = conversation
        self.input_items = input_items
        self.sampling: Dict[str, Any] = {}  # the sampling params it ran with (the echoed temperature, top_p)
        self.sequence: Iterator[int] = itertools.count()  # its stream's sequence_number

    @property
    def stream(self) -> bool:  # (what OpenAIServingBase._generate asks)
        return bool(self.request.stream)


class OpenAIServingResponses(OpenAIServingBase):
    """POST /v1/responses over the chat path, and the stored responses' routes."""

    def __init__(self, serving_chat: OpenAIServingChat, store: Optional[ResponseStore] = None) -> None:
        super().__init__(serving_chat.tokenizer_manager)
        self.chat = serving_chat
        self.store = store if store is not None else ResponseStore()

    # --- POST /v1/responses
    async def handle_request(self, request: ResponsesRequest, raw_request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return create_error_response(refused[0], param=refused[1])
        earlier: List[Dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self._stored(request.previous_response_id, "previous_response_id")
            if isinstance(previous, JSONResponse):
                return previous
            earlier = previous.conversation
        response_id = new_id("resp")
        try:
            chat, conversation, input_items = to_chat_request(request, response_id, earlier)
        except BadResponsesRequest as e:
            return create_error_response(str(e), param=e.param)
        refused_chat = self.chat.precheck(chat)  # (the chat route's checks: the model, LoRA, tools, ...)
        if refused_chat is not None:
            return refused_chat
        return await self._generate(ResponsesTurn(request, chat, response_id, conversation, input_items), raw_request)

    def _convert_to_internal_request(self, turn: ResponsesTurn) -> GenerateReqInput:
        adapted = self.chat._convert_to_internal_request(turn.chat)  # (chat's own: the template, tools' grammar, ...)
        turn.sampling = dict(adapted.sampling_params or {})
        return adapted

    async def _handle_non_streaming_request(self, adapted: GenerateReqInput, turn: ResponsesTurn, raw_request: Request) -> Response:
        answer = self.chat.chat_response(await self._collect(adapted, raw_request), turn.chat)
        choice = answer.choices[0]
        response = self._finished(turn, output_items(choice, turn.request.logprobs), choice.finish_reason, answer.usage)
        return JSONResponse(response)

    async def _stream_events(self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], adapted: GenerateReqInput, turn: ResponsesTurn) -> AsyncIterator[str]:
        yield self._event(turn, "response.created", response=self._response(turn, "in_progress", [], None))
        yield self._event(turn, "response.in_progress", response=self._response(turn, "in_progress", [], None))
        usage, output = UsageCounter(1), StreamedOutput(turn.request.logprobs)
        async for d in self.chat.stream_deltas(first, rest, turn.chat, usage, StreamedHiddenStates()):
            if d.refused is not None:  # (an abort with a status, e.g. the queue is full)
                for event in self._stream_error_events(d.refused.get("message") or "Aborted", int(d.refused["status_code"]), turn):
                    yield event
                return
            for kind, fields in output.feed(d):
                yield self._event(turn, kind, **fields)
        response = self._finished(turn, output.items, output.finish_reason, usage.usage())
        yield self._event(turn, f"response.{response['status']}", response=response)  # (completed, incomplete or failed)

    def _stream_error_events(self, message: str, status_code: int, turn: ResponsesTurn) -> List[str]:
        return [self._event(turn, "error", code=str(status_code), message=message, param=None)]

    @staticmethod
    def _event(turn: ResponsesTurn, kind: str, **fields: Any) -> str:
        """One SSE event as OpenAI frames them: its type as the event name, then its data."""
        body = {"type": kind, **fields, "sequence_number": next(turn.sequence)}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    # --- the response object
    def _finished(self, turn: ResponsesTurn, output: List[Dict[str, Any]], finish_reason: Optional[str], usage: UsageInfo) -> Dict[str, Any]:
        """The finished response (stored when `store` is not false)."""
        status, error = "completed", None
        if finish_reason == "length":
            status = "incomplete"
        elif finish_reason == "abort":  # (aborted without a status: /abort_request, a shutdown)
            status, error = "failed", {"code": "server_error", "message": "The request was aborted before it finished"}
        response = self._response(turn, status, output, self._usage(usage, output), error=error)
        if turn.request.store is not False:
            conversation = turn.conversation + [output_as_message(output)]
            self.store.put(StoredResponse(response, turn.input_items, conversation))
        return response

    def _usage(self, usage: UsageInfo, output: List[Dict[str, Any]]) -> Dict[str, Any]:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        # (the reasoning's tokens, counted again from its text: the tags around it are not counted)
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": usage.prompt_tokens,
            # every prompt token not found in the radix tree is written to it (cache_write_tokens)
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": usage.prompt_tokens - cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.total_tokens,
        }

    def _response(self, turn: ResponsesTurn, status: str, output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]],
                  error: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:  # fmt: skip
        """The response object as the SDK types it (openai.types.responses.Response), echoing the request's settings."""
        r, chat = turn.request, turn.chat
        text_format = (r.text.format if r.text is not None else None) or {"type": "text"}
        return {
            "id": turn.id,
            "object": "response",
            "created_at": turn.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "metadata": r.metadata or {},
            "model": r.model,
            "output": output,
            "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": r.store is not False,
            # (what it ran with: the request's, else the model's generation_config, else the built-in default)
            "temperature": turn.sampling.get("temperature", r.temperature),
            "top_p": turn.sampling.get("top_p", r.top_p),
            "text": {"format": text_format},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": list(r.tools or []),
            "top_logprobs": r.top_logprobs or 0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }

    # --- the stored responses
    def _stored(self, response_id: str, param: str) -> Union[StoredResponse, JSONResponse]:
        """The stored response, or the error response that says why there is none."""
        if not response_id.startswith("resp_"):
            return create_error_response(f"Invalid {param} {response_id!r}: a response id begins with 'resp_'", param=param)
        entry = self.store.get(response_id)
        if entry is None:
            return create_error_response(
                f"Response with id {response_id!r} not found: it was never stored (store: false), was deleted, or is older "
                f"than the last {self.store.capacity} stored responses this server keeps (or the server restarted)",
                status_code=404, err_type="NotFoundError", param=param,
            )  # fmt: skip
        return entry

    @staticmethod
    def _no_query(raw_request: Request) -> Optional[JSONResponse]:
        extra = sorted(raw_request.query_params)
        if extra:
            return create_error_response(f"Query parameters {extra} are not supported by minisgl on this route", param=extra[0])
        return None

    def retrieve(self, response_id: str, raw_request: Request) -> Response:
        """GET /v1/responses/{id} (its stream replay, ?stream=true, is not built: refused with the other query parameters)."""
        refused = self._no_query(raw_request)
        if refused is not None:
            return refused
        entry = self._stored(response_id, "response_id")
        return entry if isinstance(entry, JSONResponse) else JSONResponse(entry.response)

    def delete(self, response_id: str) -> Response:
        entry = self._stored(response_id, "response_id")
        if isinstance(entry, JSONResponse):
            return entry
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, response_id: str) -> Response:
        entry = self._stored(response_id, "response_id")
        if isinstance(entry, JSONResponse):
            return entry
        return create_error_response(
            "Only background responses can be cancelled, and minisgl builds none (background: true is refused): this response "
            "finished before it was returned. To stop a streamed response, close its connection.",
            param="response_id",
        )

    def input_items(self, response_id: str, raw_request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: the request's own input (not the earlier turns'), OpenAI's
        list page: ?limit= (1-100, 20), ?order= (desc, the default: newest first; or asc), ?after= (an item id)."""
        query = dict(raw_request.query_params)
        extra = sorted(set(query) - {"limit", "order", "after"})
        if extra:
            return create_error_response(f"Query parameters {extra} are not supported by minisgl on this route", param=extra[0])
        entry = self._stored(response_id, "response_id")
        if isinstance(entry, JSONResponse):
            return entry
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= INPUT_ITEMS_MAX_LIMIT:
            return create_error_response(f"limit must be an integer from 1 to {INPUT_ITEMS_MAX_LIMIT}, got {limit!r}", param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            return create_error_response(f'order must be "asc" or "desc", got {order!r}', param="order")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                return create_error_response(f"after {query['after']!r} is not an input item of {response_id}", param="after")
            items = items[ids.index(query["after"]) + 1 :]
        page = items[: int(limit)]
        return JSONResponse({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page),
        })  # fmt: skip
