"""OpenAIServingBase (stage 1, seed 000). In: a validated protocol request. Out: an HTTP response.

Where it sits: the FastAPI route hands the pydantic request to `handle_request`, which
runs `_validate_request` -> `_convert_to_internal_request` (-> GenerateReqInput) and
then the streaming or non-streaming path over `TokenizerManager.generate_request`.
Subclasses (chat, completions) supply the conversion and the response shapes; this
module owns the error mapping (never a 500 for bad input) and the shared helpers
(finish reasons, usage, token strings).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
import logging
import time
import uuid
from http import HTTPStatus
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Pattern, Sequence, Tuple, Union

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from minisgl.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo
from minisgl.managers.io_struct import LOGPROB_META_KEYS, GenerateReqInput, entry_as_list
from minisgl.managers.tokenizer_manager import GENERATION_ON_EMBEDDING_SERVER, ReqAbortedError, TokenizerManager
from minisgl.sampling.sampling_params import GRAMMAR_KEYS
from minisgl.utils import ParamError

logger = logging.getLogger("minisgl.serving")


def error_body(message: str, status_code: int = 400, err_type: Optional[str] = None, param: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's envelope: the openai SDKs read `error.message` / `.type` / `.param` / `.code` from it."""
    if err_type is None:
        # (as OpenAI's and SGLang's names: BadRequestError, ServiceUnavailableError, ...)
        phrase = HTTPStatus(status_code).phrase.replace(" ", "")
        err_type = "BadRequestError" if status_code == 400 else phrase if phrase.endswith("Error") else phrase + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status_code)).model_dump()


def encodable(message: str) -> str:
    """`message` with any lone surrogate written as an escape. A message may quote user input with
    lone surrogates (a "model": "x\\ud800" echoed in a 404), which JSON cannot encode: escaped, the
    error itself never fails to encode (a 500). Every route's error body (OpenAI's, Anthropic's,
    Ollama's) goes through it."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def openai_error_message(response: JSONResponse) -> str:
    """The message of a chat-path error response (OpenAI's envelope), for a route that says it in its own envelope."""
    return json.loads(response.body)["error"]["message"]


# the message of a request aborted without a status (/abort_request, a shutdown), on the routes
# whose answer has no finish reason that says it (Anthropic's, Ollama's): a 500
ABORTED = "The request was aborted before it finished (/abort_request, or the server shutting down)"


def create_error_response(message: str, status_code: int = 400, err_type: Optional[str] = None, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(encodable(message), status_code, err_type, param), status_code=status_code)


def error_param(e: Exception) -> Optional[str]:
    """The field an error is about, as its raiser named it (ParamError; a scheduler's abort that
    named one), else None. The routes read the field here, never from the message's words."""
    return e.param if isinstance(e, (ParamError, ReqAbortedError)) else None


def handler_error_response(e: Exception, param: Optional[str] = None) -> JSONResponse:
    """What a route's handler raised, as its OpenAI error: an HTTPException's status, an aborted
    request's (ReqAbortedError: 400, 503, ...), a ValueError's 400 (bad input found late, e.g. by
    the tokenizer), anything else a logged 500. `param`: the field the error is about, by the
    route's name (OpenAIServingBase.error_response). Call it inside the `except` block (it logs the traceback)."""
    if isinstance(e, HTTPException):
        return create_error_response(str(e.detail), status_code=e.status_code)
    if isinstance(e, ReqAbortedError):
        return create_error_response(e.message, status_code=e.status_code, param=param)
    if isinstance(e, ValueError):
        return create_error_response(str(e), param=param)
    logger.exception("Internal server error")
    return create_error_response(f"Internal server error: {e}", status_code=500, err_type="InternalServerError")


def unknown_model_response(model: str, served: str) -> Optional[JSONResponse]:
    """The 404 for a model this server does not serve; None for its name or "default" (which
    names whatever this server serves: handy for clients written for any model)."""
    if model in (served, "default"):
        return None
    return create_error_response(
        f"The model `{model}` does not exist. Served model: `{served}`.", status_code=404, err_type="NotFoundError", param="model"
    )


def split_lora_model(model: str, served: str) -> Tuple[str, Optional[str]]:
    """SGLang's `model` syntax for LoRA: "BASE:ADAPTER" -> ("BASE", "ADAPTER"); the served name itself
    or a name without a colon -> (model, None). A served name holding a colon ("llama3:8b") still
    reaches adapters: "llama3:8b:a" is that model with adapter "a" (the prefix is matched first,
    then the first colon splits). The adapter is stripped, and an empty one is no adapter (SGLang's)."""
    if model in (served, "default"):
        return model, None
    for base in (served, "default"):
        if model.startswith(base + ":"):
            return base, model[len(base) + 1 :].strip() or None
    if ":" not in model:
        return model, None
    base, adapter = model.split(":", 1)
    return base, adapter.strip() or None


def sse_event(kind: str, body: Dict[str, Any]) -> str:
    """One SSE event as the Responses and Messages APIs frame theirs: `event: <kind>`, then
    `data: <body as compact JSON>` and a blank line (`body` carries its own "type": kind)."""
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    """An id of OpenAI's and Anthropic's shape: a prefix, "_" and 32 hex digits (resp_..., msg_..., toolu_...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reword(message: str, rules: Sequence[Tuple[Pattern[str], str]]) -> str:
    """A chat-path error message in another API's words: each rule's pattern replaced by its words,
    in order (the Responses and Messages APIs name chat's fields by their own)."""
    for pattern, words in rules:
        message = pattern.sub(words, message)
    return message


def sse_data(obj: Any) -> str:
    """One SSE event, framed: `data: <json>` and a blank line. `obj`: a pydantic model, a dict or "[DONE]"."""
    if isinstance(obj, BaseModel):
        # nulls included: a chunk spells out finish_reason / logprobs / usage: null, as OpenAI's
        # and SGLang's do (only DeltaMessage drops its unset keys). pydantic's own (Rust) encoder.
        payload = obj.model_dump_json()
    elif isinstance(obj, str):
        payload = obj
    else:
        payload = json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n"


# Proxies (nginx) buffer responses unless told not to; a stream must reach the client as produced.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[Union[str, bytes]]) -> StreamingResponse:
    """Stream framed SSE events (sse_data) as they come, as SGLang does.

    A plain StreamingResponse, not sse-starlette's EventSourceResponse: that one wraps every
    event in a send timeout and a ping task group, which cost more than the token itself on a
    2-core CPU (the HTTP process then steals time from the scheduler's matmul threads).
    A client disconnect still cancels `events` (starlette listens for http.disconnect), so
    its `finally` aborts the request.
    """
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def openai_finish_reason(reason: Optional[Dict[str, Any]]) -> Tuple[Optional[str], Optional[Any]]:
    """SGLang's finish_reason dict -> OpenAI's finish_reason string and SGLang's matched_stop."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    return kind, None  # "length" or "abort"


def abort_status(reason: Optional[Dict[str, Any]]) -> Optional[int]:
    """The HTTP status an abort carries (e.g. 503 when the queue is full), else None."""
    if isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("status_code"):
        return int(reason["status_code"])
    return None


def abort_events(reason: Optional[Dict[str, Any]], param: Optional[str] = None) -> List[str]:
    """The SSE events that end a stream whose request was refused with a status (the error, then
    [DONE]); [] for any other finish, which the stream renders itself. `param`: the field the abort
    is about (its reason's "param"), by the route's name."""
    status = abort_status(reason)
    if status is None:
        return []
    return [sse_data(error_body(reason.get("message") or "Aborted", status, param=param)), sse_data("[DONE]")]


def response_id(out: Dict[str, Any], n: int) -> str:
    """The response id: the request's rid (the samples of n > 1 are `<rid>-<j>`; a batch's
    prompts keep their own rids, and the response takes the first one's)."""
    rid = out["meta_info"]["id"]
    return rid.rsplit("-", 1)[0] if n > 1 else rid


def joined(outs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A streamed request's outputs (each what it adds) as the one output a non-streamed request
    gets: the texts, token ids and logprob lists concatenated, the last output's other meta_info."""
    meta = dict(outs[-1]["meta_info"])
    for key in LOGPROB_META_KEYS:
        if any(key in out["meta_info"] for out in outs):
            meta[key] = [entry for out in outs for entry in out["meta_info"].get(key) or []]
    return {"text": "".join(out["text"] for out in outs), "output_ids": [i for out in outs for i in out["output_ids"]], "meta_info": meta}


async def prepend(first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]]) -> AsyncIterator[Dict[str, Any]]:
    """`first` (already awaited, so errors surfaced before the headers) followed by the rest."""
    yield first
    async for out in rest:
        yield out


class UsageCounter:
    """Usage over the choices of one response: prompt counted once per prompt (idx % n == 0)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt_tokens: Dict[int, int] = {}
        self.completion_tokens: Dict[int, int] = {}
        self.cached_tokens: Dict[int, int] = {}

    def update(self, index: int, meta_info: Dict[str, Any]) -> None:
        self.prompt_tokens[index] = meta_info["prompt_tokens"]
        self.completion_tokens[index] = meta_info["completion_tokens"]
        self.cached_tokens[index] = meta_info.get("cached_tokens", 0)

    def choice_usage(self, index: int) -> UsageInfo:
        """One choice's usage so far (stream_options.continuous_usage_stats: its prompt, its tokens)."""
        prompt, completion = self.prompt_tokens.get(index, 0), self.completion_tokens.get(index, 0)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens.get(index, 0)),
        )

    def usage(self) -> UsageInfo:
        prompt = sum(v for i, v in self.prompt_tokens.items() if i % self.n == 0)
        cached = sum(v for i, v in self.cached_tokens.items() if i % self.n == 0)
        completion = sum(self.completion_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


def last_hidden_state(meta_info: Dict[str, Any], request: Any) -> Optional[List[float]]:
    """A choice's `hidden_states` (SGLang's process_hidden_states_from_ret, entrypoints/openai/utils.py):
    None unless the request asked; else the last entry of meta_info["hidden_states"], the hidden
    state of the output token the last decode step fed in, or [] when there is only the prompt's
    entry (max_tokens 1: no decode step ran). The prompt's rows never reach an OpenAI client."""
    if not request.return_hidden_states:
        return None
    entries = meta_info.get("hidden_states")
    if entries is None:
        return None
    return entry_as_list(entries[-1]) if len(entries) > 1 else []  # (one float32 row: cheap here)


class StreamedHiddenStates:
    """A stream's hidden states, per choice, for the chunk SGLang sends after the finish chunks (and
    before the usage chunk): `{"index", <the choice's hidden_states>, "finish_reason": null}` per
    choice that had any, the last entry as last_hidden_state picks it. The streamed dicts carry what
    each adds: only the count and the last entry are kept, not the prompt's rows."""

    def __init__(self) -> None:
        self.count: Dict[int, int] = {}  # choice index -> entries so far (in the order choices first came)
        self.last: Dict[int, Any] = {}  # (its last entry, a float32 row)

    def update(self, index: int, meta_info: Dict[str, Any]) -> None:
        entries = meta_info.get("hidden_states")
        if entries is None:  # (it did not ask)
            return
        self.count[index] = self.count.get(index, 0) + len(entries)
        if entries:
            self.last[index] = entries[-1]

    def final(self) -> List[Tuple[int, List[float]]]:
        return [(index, entry_as_list(self.last[index]) if count > 1 else []) for index, count in self.count.items() if count > 0]


async def collect_outputs(tm: TokenizerManager, adapted: GenerateReqInput, raw_request: Request) -> List[Dict[str, Any]]:
    """All final outputs of a non-streaming request, ordered by choice index."""
    outs = [out async for out in tm.generate_request(adapted, raw_request)]
    return sorted(outs, key=lambda out: out.get("index", 0))


async def start_stream(tm: TokenizerManager, adapted: GenerateReqInput, raw_request: Request) -> Tuple[Dict[str, Any], AsyncIterator[Dict[str, Any]]]:
    """(the first output, the generator of the rest) of a streamed request. The first is awaited
    before the headers are sent, so that tokenization and context-length errors are a real HTTP
    400, not an error event after a 200."""
    gen = tm.generate_request(adapted, raw_request)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        raise ValueError("The request produced no output")
    return first, gen


async def guarded_stream(
    events: AsyncIterator[str], gen: Any, error_events: Callable[[str, int, Optional[str]], List[str]]
) -> AsyncIterator[str]:
    """`events` (a writer's SSE events over `gen`), where an error after the headers becomes the
    route's `error_events(message, status, param)` (chat: an error body + [DONE]; Responses: an
    `error` event; param: error_param's, /generate's name); `gen` is always closed: a disconnect
    cancels us here and the TokenizerManager aborts the rid."""
    try:
        async for event in events:
            yield event
    except ReqAbortedError as e:
        for event in error_events(e.message, e.status_code, e.param):
            yield event
    except ValueError as e:
        for event in error_events(str(e), 400, error_param(e)):
            yield event
    finally:
        await gen.aclose()


# /generate's field names (what the TokenizerManager's and SamplingParams' errors name) -> the
# OpenAI routes' (/v1/completions'; chat adds its own: OpenAIServingChat.route_param)
_ENGINE_TO_OPENAI = {"text": "prompt", "input_ids": "prompt", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _from_response_format(param: str, request: Any) -> bool:
    """Whether `param`, a grammar's key, names a grammar the request's response_format built (a
    json_object's or json_schema's `json_schema`), not the route's own field of that name."""
    if param not in GRAMMAR_KEYS or getattr(request, param, None) is not None:
        return False
    response_format = getattr(request, "response_format", None)
    return response_format is not None and param in response_format.grammar()


class OpenAIServingBase(ABC):
    """handle_request: validate -> convert -> stream or not, with SGLang's error mapping."""

    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.tokenizer = tokenizer_manager.tokenizer
        self._token_str_cache: Dict[int, str] = {}
        self._stand_in: Optional[List[int]] = None  # (text_offsets' left context for an answer)
        self._special: Optional[set] = None  # (text_offsets' special ids)

    # --- subclass hooks
    def _validate_request(self, request: Any) -> Optional[Tuple[str, Optional[str]]]:
        """(the message, the field it is about or None) of what the route refuses, else None."""
        return None

    def route_param(self, param: Optional[str], request: Any) -> Optional[str]:
        """The field an engine error names (/generate's name: error_param) by this route's name; a
        grammar's key (a scheduler's abort) is response_format's when the grammar came from there."""
        if param is None:
            return None
        if _from_response_format(param, request):
            return "response_format"
        return _ENGINE_TO_OPENAI.get(param, param)

    @abstractmethod
    def _convert_to_internal_request(self, request: Any) -> GenerateReqInput:
        """Protocol request -> GenerateReqInput (which no longer knows where it came from)."""

    @abstractmethod
    async def _handle_non_streaming_request(self, adapted: GenerateReqInput, request: Any, raw_request: Request) -> Response:
        """Collect the final outputs and render one JSON response."""

    @abstractmethod
    def _stream_events(self, first: Dict[str, Any], rest: AsyncIterator[Dict[str, Any]], adapted: GenerateReqInput, request: Any) -> AsyncIterator[str]:
        """Render the output dicts (starting with `first`) as SSE events, ending with [DONE]."""

    def _base_model(self, request: Any) -> str:
        return split_lora_model(request.model, self.tokenizer_manager.model_name)[0]

    def _lora_path(self, request: Any) -> Optional[str]:
        """The request's adapter: `model` "BASE:NAME" (it wins, as in SGLang), else the lora_path field.
        The TokenizerManager checks the name (a 400 listing the loaded adapters)."""
        adapter = split_lora_model(request.model, self.tokenizer_manager.model_name)[1]
        return adapter if adapter is not None else request.lora_path

    @staticmethod
    def _extra_key(request: Any) -> Optional[str]:
        """The request's cache namespace, SGLang's _compute_extra_key: cache_salt + extra_key, the
        empty or absent ones left out (None when both are). Joined as SGLang joins them, so a gateway
        that sets cache_salt per tenant must drop the clients' extra_key (docs/server.md)."""
        parts = [v for v in (request.cache_salt, request.extra_key) if v]
        return "".join(parts) if parts else None

    # --- the shared path
    async def handle_request(self, request: Any, raw_request: Request) -> Response:
        refused = self.precheck(request)
        if refused is not None:
            return refused
        return await self._generate(request, raw_request)

    def precheck(self, request: Any) -> Optional[JSONResponse]:
        """The error response for a request this server cannot run (an unknown model, an adapter
        without LoRA, generation on an embedding server, a field the subclass refuses), else None.
        (Also what the Responses route runs on the chat request it translates to.)"""
        unknown = unknown_model_response(self._base_model(request), self.tokenizer_manager.model_name)
        if unknown is not None:
            return unknown
        adapter = split_lora_model(request.model, self.tokenizer_manager.model_name)[1]
        if adapter is not None and self.tokenizer_manager.lora_registry is None:  # (LoRA off)
            # (said about `model`, which named it; the TokenizerManager's message is about lora_path)
            return create_error_response(
                f"model {request.model!r} names LoRA adapter {adapter!r} (\"BASE:ADAPTER\"), but this server serves "
                f"no adapters: send model {self._base_model(request)!r}, or start the server with --lora-paths {adapter}=PATH "
                "(or --enable-lora, then /load_lora_adapter)",
                param="model",
            )
        if self.tokenizer_manager.is_embedding:  # (the TokenizerManager refuses it too; said first, before any other check)
            return create_error_response(GENERATION_ON_EMBEDDING_SERVER)
        if request.stream_options is not None and not request.stream:
            # OpenAI's rule: stream_options only shapes a stream, so without one it is an error, not ignored
            return create_error_response("stream_options is only allowed when stream is true", param="stream_options")
        error = self._validate_request(request)
        if error is not None:
            return create_error_response(error[0], param=error[1])
        return None

    async def _generate(self, request: Any, raw_request: Request) -> Response:
        """Convert, then answer as a stream or as one response; what it raises becomes its error response."""
        received_time = time.time()
        try:
            adapted = self._convert_to_internal_request(request)
            logger.debug("Request converted at %.3f: rid=%s", received_time, adapted.rid)
            if request.stream:
                return await self._handle_streaming_request(adapted, request, raw_request)
            return await self._handle_non_streaming_request(adapted, request, raw_request)
        except Exception as e:
            return self.error_response(e, request)

    def error_response(self, e: Exception, request: Any) -> JSONResponse:
        """handler_error_response, with the field the error is about by this route's name."""
        return handler_error_response(e, self.route_param(error_param(e), request))

    async def _handle_streaming_request(self, adapted: GenerateReqInput, request: Any, raw_request: Request) -> Response:
        first, gen = await start_stream(self.tokenizer_manager, adapted, raw_request)
        events = self._stream_events(first, gen, adapted, request)

        def error_events(message: str, status: int, param: Optional[str]) -> List[str]:
            return [sse_data(error_body(message, status, param=self.route_param(param, request))), sse_data("[DONE]")]

        return sse_response(guarded_stream(events, gen, error_events))

    async def _collect(self, adapted: GenerateReqInput, raw_request: Request) -> List[Dict[str, Any]]:
        return await collect_outputs(self.tokenizer_manager, adapted, raw_request)

    # --- helpers for logprobs
    def token_str(self, token_id: int) -> str:
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_str_cache[token_id] = s
        return s

    def text_offsets(self, token_ids: List[int], text: str, start: int = 0, continues: bool = False) -> List[int]:
        """Where each token begins in `text` (what the tokens decode to), in characters, plus `start`.

        Not the sum of token_str lengths: a character split over byte tokens prints as one
        U+FFFD per token but is one character of the text. The tokens are decoded
        incrementally from the last point where they were in step with the text (the
        detokenizer's window, kept as left context); a token begins where the decoded text
        stops agreeing with `text`, so the bytes of one character all begin where it does, and
        a lone invalid byte, a U+FFFD of the text too, is one character. A special token the
        text leaves out (a BOS the tokenizer added, one skip_special_tokens dropped) takes no
        room. `continues`: the text goes on from earlier text (an answer after its prompt), so
        the first tokens are decoded after a stand-in token: a SentencePiece decoder drops the
        leading space of a decode's first token, which the detokenizer's left context kept.
        Never decreasing, at most start + len(text)."""
        special_ids = self._special_ids()
        offsets: List[int] = []
        synced = 0  # characters of `text` the tokens up to the last point in step decode to
        # the last group in step: left context for decoding the next
        context: List[int] = self._stand_in_context() if continues else []
        pending: List[int] = []  # the tokens since, not yet in step with the text
        head, piece = self.tokenizer.decode(context), ""  # decode(context); what context + pending decode to past it
        for token_id in token_ids:
            agreed = synced + _common_prefix_len(piece, text, synced)
            offsets.append(start + max(agreed, offsets[-1] - start if offsets else 0))
            if token_id in special_ids and not text.startswith(self.token_str(token_id), agreed):
                continue
            pending.append(token_id)
            piece = self.tokenizer.decode(context + pending)[len(head) :]
            if text.startswith(piece, synced):  # in step again: the text so far, exactly
                synced += len(piece)
                context, pending = pending, []
                head, piece = self.tokenizer.decode(context), ""
        return offsets

    def _special_ids(self) -> set:
        """Every special token: the named ones (all_special_ids: bos, eos, pad...) and the added
        tokens marked special (a chat template's <|im_start|>), which skip_special_tokens drops too."""
        if self._special is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            self._special = set(self.tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        return self._special

    def _stand_in_context(self) -> List[int]:
        """One ordinary token to decode after (the last of "a")."""
        if self._stand_in is None:
            self._stand_in = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
        return list(self._stand_in)


def _common_prefix_len(a: str, b: str, b_start: int = 0) -> int:
    """How many leading characters of `a` match `b` from b_start (no slice of b: a long echo
    compared token by token would copy its tail once per token)."""
    n = min(len(a), len(b) - b_start)
    for i in range(n):
        if a[i] != b[b_start + i]:
            return i
    return max(n, 0)
