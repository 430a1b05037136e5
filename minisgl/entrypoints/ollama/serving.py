"""OllamaServing (stage 1, the Ollama API). In: a checked OllamaChatRequest / OllamaGenerateRequest /
OllamaShowRequest. Out: Ollama's answers, over the chat path (OpenAIServingChat's public methods).

    /api/chat, /api/generate -> convert.py -> ChatCompletionRequest -> chat's precheck, to_generate_request
        -> TokenizerManager (always streamed inside: the first output's time is the prompt's evaluation)
        -> a stream: StreamedAnswer (stream.py) -> newline-delimited JSON chunks, then a final chunk
           with done, done_reason and Timings' counts and durations
        -> no stream: the outputs joined, chat's chat_response, one object with the same final fields
    /api/tags, /api/show, /api/ps, /api/version -> model_info.py

/api/generate with raw: true sends its prompt as it is (no chat template, no thinking split out),
with the same sampling fields. Errors are Ollama's `{"error": "..."}` with its status codes (404
for a model this server does not serve, 400 for bad input); a stream's error after its first line
is an `{"error": ...}` line (the `ollama` client raises it). A client that hangs up aborts the
request (guarded_stream closes it, as on chat).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.chat_template import template_variables
from minisgl.entrypoints.ollama.convert import (
    BadOllamaRequest, chat_messages, check_generate, done_reason, generate_messages, keep_alive_seconds, num_ctx, ollama_logprobs,
    ollama_tool_calls, think_fields, to_chat_request,
)  # fmt: skip
from minisgl.entrypoints.ollama.model_info import ServedModel, served_model
from minisgl.entrypoints.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest, _OllamaRequest
from minisgl.entrypoints.ollama.stream import StreamedAnswer, Timings
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest
from minisgl.entrypoints.openai.serving_base import (
    ABORTED, SSE_HEADERS, StreamedHiddenStates, abort_status, UsageCounter, encodable, guarded_stream, handler_error_response, joined,
    new_id, openai_error_message, start_stream,
)  # fmt: skip
from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat

# GET /api/version: the Ollama release whose API (docs/api.md, api/types.go) these routes follow.
# Clients read it to decide what a server can do (think, tools, ...): minisgl's own version (0.x)
# would read as an Ollama from before those existed.
OLLAMA_API_VERSION = "0.32.15"


def ollama_error_response(message: str, status_code: int = 400) -> JSONResponse:
    """Ollama's error body: {"error": message} (what the `ollama` client's ResponseError reads)."""
    return JSONResponse({"error": encodable(message)}, status_code=status_code)


def from_openai_error(response: JSONResponse) -> JSONResponse:
    """A chat-path error response (OpenAI's envelope) as Ollama says it."""
    return ollama_error_response(openai_error_message(response), response.status_code)


def _line(obj: Dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _error_lines(message: str, status_code: int, param: Optional[str] = None) -> List[str]:
    # (status and param unused: a stream's error line is Ollama's {"error"} alone)
    return [_line({"error": message})]


def _refused(out: Dict[str, Any]) -> Optional[JSONResponse]:
    """The error response of an output that ends its request with an HTTP status (the queue full, a
    grammar refused: the streamed request the route runs inside gets it as an output), else None."""
    reason = out["meta_info"]["finish_reason"]
    status = abort_status(reason)
    return None if status is None else ollama_error_response(reason.get("message") or "Aborted", status)


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC, with microseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaServing:
    """The Ollama API's routes over the chat path."""

    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        self.chat = serving_chat
        self.tokenizer_manager = serving_chat.tokenizer_manager

    # --- the model
    def served_name(self, model: str) -> str:
        """`model` as the chat path names it: Ollama's implicit tag (`NAME:latest`) of the served name dropped."""
        for name in (self.tokenizer_manager.model_name, "default"):
            if model == f"{name}:latest":
                return name
        return model

    def _not_found(self, model: str) -> JSONResponse:
        served = self.tokenizer_manager.model_name
        return ollama_error_response(f"model '{model}' not found (this server serves '{served}')", 404)

    def _served_model(self) -> ServedModel:
        tm = self.tokenizer_manager
        return served_model(tm.model_name, tm.model_path or "", tm.weight_version, tm.context_len)

    # --- POST /api/chat and /api/generate
    async def handle_chat(self, request: OllamaChatRequest, raw_request: Request) -> Response:
        try:
            messages = chat_messages(request.messages or [])
        except BadOllamaRequest as e:
            return ollama_error_response(str(e))
        return await self._answer(request, messages, raw_request, chat=True)

    async def handle_generate(self, request: OllamaGenerateRequest, raw_request: Request) -> Response:
        try:
            check_generate(request)
        except BadOllamaRequest as e:
            return ollama_error_response(str(e))
        messages = generate_messages(request) if request.prompt else []
        return await self._answer(request, messages, raw_request, chat=False, raw=bool(request.raw))

    async def _answer(self, request: _OllamaRequest, messages: List[Dict[str, Any]], raw_request: Request, chat: bool,
                      raw: bool = False) -> Response:  # fmt: skip
        timings = Timings()
        translated = self._translate(request, messages, raw)
        if isinstance(translated, JSONResponse):
            return translated
        if not messages:  # Ollama's "load" call: nothing to generate; the model is loaded
            body = self._head(request, chat, "")
            return JSONResponse({**body, "done": True, "done_reason": "load"})
        try:
            if raw:  # (the prompt as it is, every other field as the chat path sets it)
                adapted = self.chat.to_raw_generate_request(translated, translated.messages[-1].text())
            else:
                adapted = self.chat.to_generate_request(translated)
            first, gen = await start_stream(self.tokenizer_manager, adapted, raw_request)
        except Exception as e:
            return from_openai_error(handler_error_response(e))
        timings.first_output()
        refused = _refused(first) or self._past_num_ctx(request, first)
        if refused is not None:  # (refused before any token is sent, e.g. a grammar without xgrammar: a real HTTP error)
            await gen.aclose()
            return refused
        if request.streams:
            lines = self._stream(first, gen, translated, request, chat, timings)
            return StreamingResponse(guarded_stream(lines, gen, _error_lines), media_type="application/x-ndjson", headers=SSE_HEADERS)
        try:
            outs = [first] + [out async for out in gen]
        except Exception as e:
            return from_openai_error(handler_error_response(e))
        finally:
            await gen.aclose()
        timings.finished()
        refused = _refused(outs[-1])
        if refused is not None:
            return refused
        return self._whole(joined(outs), translated, request, chat, timings)

    def _past_num_ctx(self, request: _OllamaRequest, first: Dict[str, Any]) -> Optional[JSONResponse]:
        """The 400 for a prompt longer than option num_ctx (convert.num_ctx: Ollama would cut it,
        minisgl does not), known from the first output's prompt_tokens; else None."""
        limit = num_ctx((request.options or {}).get("num_ctx"), self.tokenizer_manager.context_len)
        prompt_tokens = first["meta_info"].get("prompt_tokens", 0)
        if limit is None or prompt_tokens <= limit:
            return None
        return ollama_error_response(f"option 'num_ctx' {limit} is shorter than the prompt ({prompt_tokens} tokens): Ollama would cut "
                                     "the prompt to fit, minisgl does not cut one; send a shorter prompt, a larger num_ctx, or "
                                     "leave num_ctx out")  # fmt: skip

    def _translate(self, request: _OllamaRequest, messages: List[Dict[str, Any]], raw: bool) -> Union[ChatCompletionRequest, JSONResponse]:
        """The chat request that runs `request`, or the error response that says why there is none (no
        `messages`: Ollama's load call, checked as a request of one empty user message)."""
        tm = self.tokenizer_manager
        model = self.served_name(request.model)
        try:
            read = template_variables(getattr(self.chat.tokenizer, "chat_template", None))
            fields = {} if raw else think_fields(request.think, request.model, tm.server_args.reasoning_parser, read)
            if not messages and keep_alive_seconds(request.keep_alive) == 0:
                raise BadOllamaRequest("keep_alive 0 with no prompt is Ollama's call to unload the model, which minisgl cannot do: it "
                                       "serves one model for its whole life (stop the server to free its memory)")  # fmt: skip
            translated = to_chat_request(request, messages or [{"role": "user", "content": ""}], new_id("ollama"), tm.context_len, fields, raw=raw)
        except BadOllamaRequest as e:
            return ollama_error_response(str(e))
        translated.model = model
        refused = self.chat.precheck(translated)  # (the chat route's checks: the model, LoRA, tools, ...)
        if refused is not None:
            return self._not_found(request.model) if refused.status_code == 404 else from_openai_error(refused)
        return translated

    def _head(self, request: _OllamaRequest, chat: bool, content: str) -> Dict[str, Any]:
        body: Dict[str, Any] = {"model": request.model, "created_at": created_at()}
        body.update({"message": {"role": "assistant", "content": content}} if chat else {"response": content})
        return body

    def _whole(self, out: Dict[str, Any], translated: ChatCompletionRequest, request: _OllamaRequest, chat: bool,
               timings: Timings) -> Response:  # fmt: skip
        choice = self.chat.chat_response([out], translated).choices[0]
        if choice.finish_reason == "abort":  # (aborted without a status: no done_reason says it)
            return ollama_error_response(ABORTED, 500)
        usage = UsageCounter(1)
        usage.update(0, out["meta_info"])
        body = self._head(request, chat, choice.message.content or "")
        place = body["message"] if chat else body
        if choice.message.reasoning_content:
            place["thinking"] = choice.message.reasoning_content
        if choice.message.tool_calls:
            place["tool_calls"] = ollama_tool_calls(choice.message.tool_calls)
        logprobs = ollama_logprobs(choice.logprobs)
        if logprobs is not None:
            body["logprobs"] = logprobs
        body.update(done=True, done_reason=done_reason(choice.finish_reason), **timings.fields(usage.usage()))
        return JSONResponse(body)

    async def _stream(self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], translated: ChatCompletionRequest,
                      request: _OllamaRequest, chat: bool, timings: Timings) -> AsyncIterator[str]:  # fmt: skip
        usage, answer = UsageCounter(1), StreamedAnswer(chat)
        async for d in self.chat.stream_deltas(first, rest, translated, usage, StreamedHiddenStates()):
            if d.refused is not None:  # (an abort with a status, e.g. the queue is full)
                yield _line({"error": d.refused.get("message") or "Aborted"})
                return
            for piece in answer.feed(d):
                yield _line({"model": request.model, "created_at": created_at(), **piece, "done": False})
        timings.finished()
        if answer.finish_reason == "abort":
            yield _line({"error": ABORTED})
            return
        final = self._head(request, chat, "")
        yield _line({**final, "done": True, "done_reason": answer.done_reason, **timings.fields(usage.usage())})

    # --- GET /api/tags, /api/ps, /api/version; POST /api/show
    def tags(self) -> Response:
        return JSONResponse({"models": [self._served_model().tags_entry()]})

    def ps(self) -> Response:
        on_gpu = str(self.tokenizer_manager.server_args.device).startswith("cuda")
        return JSONResponse({"models": [self._served_model().ps_entry(on_gpu)]})

    def version(self) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    def show(self, request: OllamaShowRequest) -> Response:
        model = request.model or request.name
        if not model:
            return ollama_error_response("model is required")
        for field in ("system", "template", "options"):  # (Ollama's client sends them empty: taken)
            if getattr(request, field):
                return ollama_error_response(f"{field} cannot be honoured by /api/show: it shows the model as if created with "
                                             f"another {field}, which minisgl cannot create (it serves one model as it is); leave it out")  # fmt: skip
        if request.verbose:
            return ollama_error_response("verbose: true asks for the tokenizer's arrays in GGUF's keys, which minisgl does not write; leave it out")
        if self.served_name(model) not in (self.tokenizer_manager.model_name, "default"):
            return self._not_found(model)
        args = self.tokenizer_manager.server_args
        capabilities = ["completion"] + (["tools"] if args.tool_call_parser else []) + (["thinking"] if args.reasoning_parser else [])
        template = getattr(self.chat.tokenizer, "chat_template", None)
        body = self._served_model().show_body(template if isinstance(template, str) else None,
                                              self.tokenizer_manager.default_sampling_params, capabilities)  # fmt: skip
        return JSONResponse(body)
