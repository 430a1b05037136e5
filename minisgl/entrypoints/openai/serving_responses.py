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
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponseChoice, ChatTokenLogprob, UsageInfo
from minisgl.entrypoints.openai.reasoning import split_reasoning
from minisgl.entrypoints.openai.responses_convert import (
    BadResponsesRequest, output_as_message, output_items, reasoning_text, responses_error, to_chat_request,
)  # fmt: skip
from minisgl.entrypoints.openai.responses_protocol import ResponsesRequest, refusal
from minisgl.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from minisgl.entrypoints.openai.responses_stream import StreamedOutput
from minisgl.entrypoints.openai.serving_base import (
    StreamedHiddenStates, UsageCounter, collect_outputs, create_error_response, guarded_stream, new_id, sse_event,
    sse_response, start_stream,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat

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


class OpenAIServingResponses:
    """POST /v1/responses over the chat path (its checks, its conversion, its answer or its
    ChatDeltas: `serving_chat`'s public methods), and the stored responses' routes."""

    def __init__(self, serving_chat: OpenAIServingChat, store: Optional[ResponseStore] = None) -> None:
        self.chat = serving_chat
        self.tokenizer_manager = serving_chat.tokenizer_manager
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
        turn = ResponsesTurn(request, chat, response_id, conversation, input_items)
        refused_chat = self.chat.precheck(chat)  # (the chat route's checks: the model, LoRA, tools, ...)
        if refused_chat is not None:
            return self._as_responses_error(refused_chat, turn)
        try:
            adapted = self.chat.to_generate_request(chat)  # (chat's own: the template, tools' grammar, ...)
            turn.sampling = dict(adapted.sampling_params or {})
            if request.stream:
                first, gen = await start_stream(self.tokenizer_manager, adapted, raw_request)
                return sse_response(guarded_stream(self._stream_events(first, gen, turn), gen, lambda message, status, param: self._error_event(turn, message, status, param)))
            outs = await collect_outputs(self.tokenizer_manager, adapted, raw_request)
        except Exception as e:
            return self._as_responses_error(self.chat.error_response(e, chat), turn)
        answer = self.chat.chat_response(outs, chat)
        choice = answer.choices[0]
        tokens = self._answer_tokens(choice, outs[0]) if request.logprobs else None
        return JSONResponse(self._finished(turn, output_items(choice, tokens), choice.finish_reason, answer.usage))

    @staticmethod
    def _as_responses_error(response: JSONResponse, turn: ResponsesTurn) -> JSONResponse:
        """A chat-path error response as the Responses route says it (responses_error: its fields by their names here)."""
        error = json.loads(response.body)["error"]
        message, param = responses_error(error["message"], error.get("param"))
        return create_error_response(message, response.status_code, err_type=error.get("type"), param=param)

    def _answer_tokens(self, choice: ChatCompletionResponseChoice, out: Dict[str, Any]) -> List[ChatTokenLogprob]:
        """The logprobs of the answer's tokens, without the reasoning's (and its tags'), as a stream
        gives its message: a token is the answer's when its text reaches into the answer."""
        tokens = (choice.logprobs.content or []) if choice.logprobs is not None else []
        parser = self.tokenizer_manager.server_args.reasoning_parser
        if parser is None:
            return tokens
        text = out["text"]
        answer_start = len(text) - len(split_reasoning(parser, text)[1])  # (the answer is the text's end)
        ids = [token_id for _, token_id, _ in out["meta_info"].get("output_token_logprobs") or []]
        ends = self.chat.text_offsets(ids, text, continues=True)[1:] + [len(text)]
        return [token for token, end in zip(tokens, ends) if end > answer_start]

    async def _stream_events(self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], turn: ResponsesTurn) -> AsyncIterator[str]:
        yield self._event(turn, "response.created", response=self._response(turn, "in_progress", [], None))
        yield self._event(turn, "response.in_progress", response=self._response(turn, "in_progress", [], None))
        usage, output = UsageCounter(1), StreamedOutput(turn.request.logprobs)
        async for d in self.chat.stream_deltas(first, rest, turn.chat, usage, StreamedHiddenStates()):
            if d.refused is not None:  # (an abort with a status, e.g. the queue is full)
                for event in self._error_event(turn, d.refused.get("message") or "Aborted", int(d.refused["status_code"]), d.refused.get("param")):
                    yield event
                return
            for kind, fields in output.feed(d):
                yield self._event(turn, kind, **fields)
        response = self._finished(turn, output.items, output.finish_reason, usage.usage())
        yield self._event(turn, f"response.{response['status']}", response=response)  # (completed, incomplete or failed)

    def _error_event(self, turn: ResponsesTurn, message: str, status_code: int, param: Optional[str]) -> List[str]:
        """How a stream ends on an error after its headers: the Responses `error` event. `param`:
        the engine's name of the field it is about (error_param's, an abort's), or None."""
        message, param = responses_error(message, self.chat.route_param(param, turn.chat))
        return [self._event(turn, "error", code=str(status_code), message=message, param=param)]

    @staticmethod
    def _event(turn: ResponsesTurn, kind: str, **fields: Any) -> str:
        """One SSE event as OpenAI frames them: its type as the event name, then its data."""
        return sse_event(kind, {"type": kind, **fields, "sequence_number": next(turn.sequence)})

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
        reasoning = reasoning_text(output)
        # (the reasoning's tokens, counted again from its text: the tags around it are not counted)
        reasoning_tokens = len(self.tokenizer_manager.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        # cache_write_tokens (required by the SDK's type: "input tokens that were written to the cache"):
        # the prefill inserts every prompt token the radix tree did not hold; with --disable-radix-cache
        # nothing is cached, so none
        written = 0 if self.tokenizer_manager.server_args.disable_radix_cache else usage.prompt_tokens - cached
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
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
        if entry is not None:
            return entry
        size = self.store.too_large(response_id)
        if size is not None:
            why = (f"it was not stored: its {size} bytes of JSON are more than the {self.store.max_bytes} bytes this server keeps of "
                   "stored responses (a long output with top_logprobs); send store: false, or fewer top_logprobs")  # fmt: skip
        else:
            why = (f"it was never stored (store: false), was deleted, or is older than what this server keeps (the last "
                   f"{self.store.capacity} stored responses, {self.store.max_bytes} bytes of them), or the server restarted")  # fmt: skip
        return create_error_response(f"Response with id {response_id!r} not found: {why}", status_code=404, err_type="NotFoundError", param=param)

    @staticmethod
    def _refused_query(raw_request: Request, built: Sequence[str] = ()) -> Optional[JSONResponse]:
        """The 400 for query parameters a route does not build (all but `built`), else None."""
        extra = sorted(set(raw_request.query_params) - set(built))
        if extra:
            return create_error_response(f"Query parameters {extra} are not supported by minisgl on this route", param=extra[0])
        return None

    def retrieve(self, response_id: str, raw_request: Request) -> Response:
        """GET /v1/responses/{id} (its stream replay, ?stream=true, is not built: refused with the other query parameters)."""
        refused = self._refused_query(raw_request)
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
        refused = self._refused_query(raw_request, ("limit", "order", "after"))
        if refused is not None:
            return refused
        query = dict(raw_request.query_params)
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
