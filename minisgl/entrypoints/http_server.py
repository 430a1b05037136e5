"""HTTP server (stage 1 + process launch, seed 004). In: HTTP. Out: HTTP, via three processes.

`launch_server(server_args)` resolves the args once, makes the ipc endpoints
(`PortArgs`, a private temp dir), spawns the Scheduler and the Detokenizer, waits for
their ready messages, then runs the FastAPI app (with the TokenizerManager) under
uvicorn in this process:

    HTTP (this process) --TokenizedGenerateReqInput--> Scheduler --BatchTokenIDOutput--> Detokenizer
          ^--------------------------------- BatchStrOutput -------------------------------+
(with --is-embedding: TokenizedEmbeddingReqInput in, BatchEmbeddingOutput back through the
detokenizer unchanged; /v1/embeddings and /encode serve, the generation routes answer 400)

With `--tp-size N` the scheduler is N processes, one per rank: rank 0 has the sockets and
broadcasts what it receives to ranks 1..N-1, which follow it (managers/tp_lockstep.py,
docs/parallelism.md).

A monitor task watches the children: if one dies, the server exits non-zero within
about a second instead of hanging. SIGINT / SIGTERM stop uvicorn; the children are then
terminated (and die with us anyway: `kill_itself_when_parent_died`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import errno
import logging
import multiprocessing as mp
import os
import shutil
import secrets
import signal
import socket
import sys
import time
from typing import Any, AsyncIterator, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from minisgl.entrypoints.anthropic.serving import AnthropicServing, anthropic_error_response
from minisgl.entrypoints.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from minisgl.entrypoints.ollama.serving import OllamaServing, ollama_error_response
from minisgl.entrypoints.hidden_states_json import StreamedEntries, answer_json, answer_numbers, off_loop_if_large
from minisgl.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EncodeRequest,
    GenerateRequest,
    GetWeightsByNameRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ProfileReqInput,
    ScoringRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    field_path,
)
from minisgl.entrypoints.openai.serving_base import (
    create_error_response, error_body, error_param, handler_error_response, prepend, sse_data, sse_response, unknown_model_response,
)  # fmt: skip
from minisgl.entrypoints.openai.responses_protocol import ResponsesRequest
from minisgl.entrypoints.openai.serving_chat import OpenAIServingChat
from minisgl.entrypoints.openai.serving_responses import OpenAIServingResponses
from minisgl.entrypoints.openai import serving_tokenize
from minisgl.entrypoints.openai.serving_completions import OpenAIServingCompletions
from minisgl.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, json_list_in_pieces
from minisgl.entrypoints.openai.serving_score import OpenAIServingScore
from minisgl.managers.io_struct import (
    LOGPROB_META_KEYS, EmbeddingReqInput, GenerateReqInput, GetWeightsByNameReqInput, LoadLoRAAdapterReqInput, LoRAUpdateOutput,
    ProfileReq, ProfileReqType, UnloadLoRAAdapterReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
)  # fmt: skip
from minisgl.managers.scheduler_profiler_mixin import refuse_unsupported_profile_args
from minisgl.managers.tokenizer_manager import ReqAbortedError, TokenizerManager
from minisgl.server_args import PortArgs, ServerArgs, resolve_server_args
from minisgl.chat_template import load_chat_template
from minisgl.utils import configure_logging, get_tokenizer

logger = logging.getLogger("minisgl.http_server")


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minisgl")
    except PackageNotFoundError:  # (run from a checkout without installing)
        return "unknown"


MINISGL_VERSION = _installed_version()

READY_TIMEOUT_S = 600.0  # loading a real model on CPU can take minutes
# --tp-size N: how long a scheduler rank's start-up failure waits for another rank's earlier one (_first_failure)
FOLLOWER_FAILURE_WAIT_S = 1.0
GRACEFUL_SHUTDOWN_S = 2  # uvicorn cancels the handlers still running after this
SHUTDOWN_ABORT_WAIT_S = 1.5  # within that: how long the scheduler gets to end aborted requests
SHUTDOWN_PROFILE_WAIT_S = 60  # how long a shutdown waits for a running profile's trace to be written
# /update_weights_from_tensor's body at most (its JSON, base64 text: ~768 MiB of tensors). The HTTP
# process holds a body several times over (the text, the parsed str, the decoded bytes, the frame
# to the scheduler): a client sends a model as buckets of this size or less (SGLang's flush_cache
# false on all but the last). SGLang has no such limit (nor a flag for one); a constant, as other caps.
MAX_UPDATE_WEIGHTS_BODY_BYTES = 1 << 30


# --------------------------------------------------------------------------- the app
def _validation_message(exc: RequestValidationError, union_tags: bool = True) -> Tuple[str, Optional[str]]:
    """Pydantic errors -> one readable message naming the field(s), and the first field as `param`.
    `union_tags` false: the fields as the Responses API names them (`input[0].role`), without
    pydantic's union branch tags (`input.str`, `input.list[any]`)."""
    parts: List[str] = []
    params: List[str] = []
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        field = ".".join(str(x) for x in loc) if union_tags else field_path(loc)
        loc = [str(x) for x in loc]
        if err.get("type") == "json_invalid":
            parts.append(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        elif err.get("type") == "extra_forbidden":
            name = loc[-1] if loc else field
            why = "is not supported by minisgl" if name in UNSUPPORTED_FIELDS else "is not a known parameter"
            parts.append(f"Unsupported parameter '{field}': it {why}")
        else:
            parts.append(f"Invalid parameter '{field}': {err.get('msg')}" if field else str(err.get("msg")))
        if field and err.get("type") != "json_invalid":  # (its loc is a character offset, not a field)
            params.append(field)
    return "; ".join(dict.fromkeys(parts)) or "Invalid request", (params[0] if params else None)


def key_matches(sent: bytes, api_key: str, prefix: str = "") -> bool:
    """Whether a header's raw bytes are `<prefix><api_key>` (Authorization's prefix "Bearer ";
    x-api-key's none).

    Compared as bytes: compare_digest refuses str with non-ASCII characters (a 500). curl
    and the openai client send a non-ASCII key as UTF-8; a browser's fetch sends characters
    up to U+00FF as one Latin-1 byte each (and refuses any above): both match.
    """
    forms = [f"{prefix}{api_key}".encode("utf-8")]
    if all(ord(c) < 256 for c in api_key):  # a key a browser can send at all
        forms.append(f"{prefix}{api_key}".encode("latin-1"))
    return any([secrets.compare_digest(sent, form) for form in forms])  # (a list: no short cut)


def bearer_matches(sent: bytes, api_key: str) -> bool:
    """Whether an Authorization header's raw bytes carry `Bearer <api_key>`."""
    return key_matches(sent, api_key, "Bearer ")


def create_app(
    server_args: ServerArgs,
    tokenizer_manager: TokenizerManager,
    is_healthy: Callable[[], bool],
    port_args: Optional[PortArgs] = None,
) -> FastAPI:
    """The FastAPI app: OpenAI routes, SGLang's native /generate, and the ops routes."""
    app = FastAPI(title="minisgl")
    _add_error_handlers(app)
    _add_body_caps(app)  # (added before the key check: the key is checked first, the size next)
    app.add_middleware(OllamaBodyIsJson)
    if server_args.api_key:
        _add_api_key_check(app, server_args.api_key)
    # SGLang's CORS: a browser page on another origin may call the server (the key still guards it).
    # Added last, so it is the outermost middleware and answers a preflight before the key check.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"])
    _add_generate_routes(app, tokenizer_manager)
    _add_ops_routes(app, tokenizer_manager, is_healthy)
    if server_args.visualize:
        from minisgl.visualizer.sse import register_visualizer_routes

        register_visualizer_routes(app, server_args, port_args)
    return app


ANTHROPIC_PREFIX = "/v1/messages"  # the Anthropic Messages API's routes: its error body, its x-api-key


def _is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class OllamaBodyIsJson:
    """Ollama reads every /api/* body as JSON whatever its Content-Type, and its documented calls are
    `curl .../api/chat -d '{...}'` (a form type): say JSON, so FastAPI parses them as Ollama would."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/") and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _is_ollama(path: str) -> bool:
    """The Ollama API's routes (/ and /api/...): their error body is Ollama's {"error": ...}."""
    return path == "/" or path.startswith("/api/")


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body (docs/server.md), or Anthropic's on its routes."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if _is_ollama(request.url.path) and any(tuple(err.get("loc", ())) == ("body",) and err.get("type") == "missing" for err in exc.errors()):
            return ollama_error_response("missing request body", 400)  # (Ollama's words for it)
        if "json" not in content_type and any(tuple(err.get("loc", ())) == ("body",) for err in exc.errors()):
            # FastAPI reads a body as JSON only when it says so: `curl -d '{...}'` sends a form
            # type, and pydantic's "Input should be a valid dictionary" said nothing useful
            message = f"Send the request body as JSON with Content-Type: application/json (got {content_type or 'no Content-Type'!r})"
            if _is_ollama(request.url.path):
                return ollama_error_response(message, 400)
            return anthropic_error_response(message, 400) if _is_anthropic(request.url.path) else create_error_response(message, 400)
        message, param = _validation_message(exc, union_tags=not request.url.path.startswith(("/v1/responses", ANTHROPIC_PREFIX, "/api/")))
        if _is_anthropic(request.url.path):
            return anthropic_error_response(message, 400)
        if _is_ollama(request.url.path):
            return ollama_error_response(message, 400)
        return create_error_response(message, 400, param=param)  # 400, never FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if _is_anthropic(request.url.path):
            return anthropic_error_response(str(exc.detail), exc.status_code)
        if _is_ollama(request.url.path):
            return ollama_error_response(str(exc.detail), exc.status_code)
        return create_error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Internal server error on %s", request.url.path)
        if _is_anthropic(request.url.path):
            return anthropic_error_response(f"Internal server error: {exc}", 500)
        if _is_ollama(request.url.path):
            return ollama_error_response(f"Internal server error: {exc}", 500)
        return create_error_response(f"Internal server error: {exc}", 500, err_type="InternalServerError")


def _add_body_caps(app: FastAPI) -> None:
    """/update_weights_from_tensor: a body over MAX_UPDATE_WEIGHTS_BODY_BYTES is refused from its
    Content-Length, before any of it is read (the route's model would read and parse it whole)."""

    @app.middleware("http")
    async def _cap_update_weights_body(request: Request, call_next: Any) -> Response:
        if request.url.path == "/update_weights_from_tensor" and request.method == "POST":
            refusal = update_weights_body_refusal(request.headers.get("content-length"))
            if refusal is not None:
                return create_error_response(refusal, 400, param="serialized_named_tensors")
        return await call_next(request)


def update_weights_body_refusal(content_length: Optional[str], limit: int = MAX_UPDATE_WEIGHTS_BODY_BYTES) -> Optional[str]:
    """Why an /update_weights_from_tensor body of this Content-Length is refused, or None."""
    if content_length is None:  # (a chunked body: its size is known only once it is read whole)
        return "Send /update_weights_from_tensor's body with a Content-Length (not chunked): its size is checked first"
    if not content_length.isdigit():
        return f"Content-Length {content_length!r} is not a byte count"
    if int(content_length) > limit:
        return (f"This /update_weights_from_tensor body is {int(content_length)} bytes; at most {limit} are taken: send "
                "the tensors as several smaller buckets (several requests, flush_cache false on all but the last)")  # fmt: skip
    return None


def _add_api_key_check(app: FastAPI, api_key: str) -> None:
    """--api-key: every route but the public ones needs `Authorization: Bearer <key>` (the Anthropic
    routes take Anthropic's `x-api-key: <key>` too)."""
    key_bytes = api_key.encode()

    def _authorized(request: Request) -> bool:
        # (starlette decodes header bytes as latin-1: encoding back gives the bytes sent)
        if bearer_matches(request.headers.get("authorization", "").encode("latin-1"), api_key):
            return True
        if _is_anthropic(request.url.path) and "x-api-key" in request.headers:
            return key_matches(request.headers["x-api-key"].encode("latin-1"), api_key)
        # A browser's EventSource cannot send headers: the visualizer page passes the
        # key as ?api_key=KEY, accepted for the /visualizer routes only.
        key = request.query_params.get("api_key", "").encode()
        return request.url.path.startswith("/visualizer") and secrets.compare_digest(key, key_bytes)

    def _public(path: str) -> bool:
        # The page's JS and CSS are the same for everyone (nothing secret in them), and a
        # <script src> / <link href> cannot carry the key: without this the page is dead.
        # The health routes and /metrics are for load balancers, probes and scrapers, which carry
        # no key (SGLang's rule); so is `/` ("Ollama is running"), the Ollama CLI's probe.
        return path in ("/", "/health", "/health_generate", "/metrics") or path.startswith("/visualizer/static/")

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next: Any) -> Response:
        # (a CORS preflight carries no key either: SGLang lets OPTIONS through)
        if request.method != "OPTIONS" and not _public(request.url.path) and not _authorized(request):
            if _is_anthropic(request.url.path):
                return anthropic_error_response("Invalid or missing API key (send x-api-key: KEY or Authorization: Bearer KEY)", 401)
            if _is_ollama(request.url.path):
                return ollama_error_response("unauthorized: invalid or missing API key (send Authorization: Bearer KEY)", 401)
            return create_error_response("Invalid or missing API key", 401, err_type="AuthenticationError")
        return await call_next(request)


def _add_generate_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """The OpenAI routes and SGLang's native /generate."""
    serving_chat = OpenAIServingChat(tm)
    serving_completions = OpenAIServingCompletions(tm)
    serving_embedding = OpenAIServingEmbedding(tm)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving_chat.handle_request(request, raw_request)

    # OpenAI's Responses API, over the chat path (docs/server.md, "Responses API")
    serving_responses = OpenAIServingResponses(serving_chat)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serving_responses.handle_request(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request) -> Response:
        return serving_responses.retrieve(response_id, raw_request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return serving_responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return serving_responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw_request: Request) -> Response:
        return serving_responses.input_items(response_id, raw_request)

    # Anthropic's Messages API, over the chat path (docs/server.md, "Anthropic Messages API")
    serving_anthropic = AnthropicServing(serving_chat)

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await serving_anthropic.handle_messages(request, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: CountTokensRequest) -> Response:
        return serving_anthropic.count_tokens(request)

    _add_ollama_routes(app, OllamaServing(serving_chat))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await serving_completions.handle_request(request, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await serving_embedding.handle_request(request, raw_request)

    serving_score = OpenAIServingScore(tm)

    @app.post("/v1/score")  # (SGLang's decoder-only scoring: docs/server.md, "Scoring")
    async def score(request: ScoringRequest, raw_request: Request) -> Response:
        return await serving_score.handle_request(request, raw_request)

    @app.api_route("/encode", methods=["POST", "PUT"])  # (SGLang's native embedding route, its methods)
    async def encode(request: EncodeRequest, raw_request: Request) -> Response:
        return await _native_encode(tm, request, raw_request)

    def model_cards() -> List[ModelCard]:
        """The served model's card, then one per loaded adapter, in load order (SGLang's ModelCard fields)."""
        cards = [ModelCard(id=tm.model_name, root=tm.model_name, max_model_len=tm.context_len)]
        for ref in tm.lora_registry.refs() if tm.lora_registry is not None else ():
            cards.append(ModelCard(id=ref.lora_name, root=ref.lora_path, parent=tm.model_name))
        return cards

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(ModelList(data=model_cards()).model_dump())

    @app.get("/v1/models/{model:path}")  # `:path`: served names may hold a slash (org/name)
    async def retrieve_model(model: str) -> Response:
        cards = model_cards()
        if unknown_model_response(model, tm.model_name) is None:  # the served name, or "default"
            return JSONResponse(cards[0].model_dump())
        # an adapter's name answers with its card (SGLang's retrieve knows the served name only)
        adapter = next((card for card in cards[1:] if card.id == model), None)
        if adapter is not None:
            return JSONResponse(adapter.model_dump())
        return unknown_model_response(model, tm.model_name)

    @app.api_route("/generate", methods=["POST", "PUT"])  # (SGLang's methods)
    async def generate(request: GenerateRequest, raw_request: Request) -> Response:
        return await _native_generate(tm, request, raw_request)

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return await serving_tokenize.tokenize(tm, request)

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return await serving_tokenize.detokenize(tm, request)


def _add_ollama_routes(app: FastAPI, serving: OllamaServing) -> None:
    """Ollama's API over the chat path (docs/server.md, "The Ollama API"), so Ollama clients work unchanged."""

    @app.api_route("/", methods=["GET", "HEAD"])
    async def ollama_probe() -> Response:
        """What the Ollama CLI probes (HEAD /) to see a server is up; nothing else lives at /."""
        return Response("Ollama is running", media_type="text/plain")

    @app.post("/api/chat")
    async def ollama_chat(request: OllamaChatRequest, raw_request: Request) -> Response:
        return await serving.handle_chat(request, raw_request)

    @app.post("/api/generate")
    async def ollama_generate(request: OllamaGenerateRequest, raw_request: Request) -> Response:
        return await serving.handle_generate(request, raw_request)

    @app.api_route("/api/tags", methods=["GET", "HEAD"])  # (Ollama's methods)
    async def ollama_tags() -> Response:
        return serving.tags()

    @app.get("/api/ps")
    async def ollama_ps() -> Response:
        return serving.ps()

    @app.api_route("/api/version", methods=["GET", "HEAD"])  # (Ollama's methods)
    async def ollama_version() -> Response:
        return serving.version()

    @app.post("/api/show")
    async def ollama_show(request: OllamaShowRequest) -> Response:
        return serving.show(request)


def _add_ops_routes(app: FastAPI, tm: TokenizerManager, is_healthy: Callable[[], bool]) -> None:
    """Health, load, metrics, cache control and profiling (SGLang's ops routes)."""

    @app.get("/health")
    async def health() -> Response:
        """Liveness: every process and the receive loop are alive."""
        return Response(status_code=200 if is_healthy() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Readiness, as SGLang's: a one-token request, and something must come back within 20 s."""
        if not is_healthy():
            return Response(status_code=503)
        return Response(status_code=200 if await tm.health_generate() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            tm.metrics.observe_load(await tm.get_load())
        except asyncio.TimeoutError:
            logger.warning("/metrics: the scheduler did not answer GetLoadReqInput; gauges are stale")
        return Response(generate_latest(tm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_load")
    async def get_load() -> Response:
        return JSONResponse(dataclasses.asdict(await tm.get_load()))

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        """SGLang's: what is served (its frontend's RuntimeEndpoint reads model_path at connect)."""
        args = tm.server_args
        return JSONResponse({"model_path": tm.model_path, "tokenizer_path": args.tokenizer_path,
                             "is_generation": not args.is_embedding, "preferred_sampling_params": None,
                             "weight_version": tm.weight_version})  # fmt: skip

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        """SGLang's: the server's arguments (the API key left out) and the scheduler's limits."""
        load = await tm.get_load()
        info = {k: v for k, v in dataclasses.asdict(tm.server_args).items() if k != "api_key"}
        # where the served weights came from: /update_weights_from_disk moves it (SGLang rewrites its
        # server_args.model_path; minisgl's are frozen), so it agrees with /get_model_info's
        info["model_path"] = tm.model_path
        info.update(max_total_num_tokens=load.max_total_num_tokens, context_len=tm.context_len,
                    max_req_input_len=tm.max_req_input_len, version=MINISGL_VERSION,
                    internal_states=[{"last_gen_throughput": load.gen_throughput}])  # fmt: skip
        return JSONResponse(info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])  # (SGLang's; its frontend's flush_cache() GETs)
    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        status = 200 if out.success else 400
        return Response(out.message or ("Cache flushed." if out.success else "Cache not flushed."), status_code=status)

    @app.api_route("/start_profile", methods=["GET", "POST"])  # (SGLang's methods; no body: every default)
    async def start_profile(obj: Optional[ProfileReqInput] = None) -> Response:
        """torch.profiler in the scheduler process (docs/server.md): a refusal is a 400 saying why."""
        obj = obj or ProfileReqInput()
        try:
            refuse_unsupported_profile_args(obj.start_step, obj.profile_by_stage, obj.merge_profiles, obj.profile_stages)
        except ValueError as e:
            return create_error_response(str(e))
        req = ProfileReq(ProfileReqType.START_PROFILE, obj.output_dir, obj.num_steps, obj.activities, obj.with_stack,
                         obj.record_shapes, obj.profile_prefix)  # fmt: skip
        return await _profile_response(tm.start_profile(req), "/start_profile")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        """Stop the profiler; it answers once the trace is written, with its path."""
        return await _profile_response(tm.stop_profile(), "/stop_profile")

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc() -> Response:
        tm.freeze_gc()  # the scheduler and the detokenizer follow through their sockets
        return JSONResponse({"message": "Garbage collection frozen in the HTTP process; the scheduler and detokenizer follow."})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        """SGLang's: load a PEFT adapter while serving; requests may name it once this answered."""
        obj = LoadLoRAAdapterReqInput(lora_name=request.lora_name, lora_path=request.lora_path, pinned=request.pinned)
        return _lora_update_response(await tm.load_lora_adapter(obj))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        """SGLang's: refuse new requests naming the adapter now; answer once its requests finished
        and its weights are gone."""
        return _lora_update_response(await tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=request.lora_name)))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest) -> Response:
        """SGLang's: load the served model's new weights from a checkpoint directory, once the
        requests in flight finished (or were aborted: abort_all_requests); 400 when refused, with
        the old weights still served. Body {success, message, num_paused_requests}, SGLang's."""
        obj = UpdateWeightFromDiskReqInput(request.model_path, request.load_format, request.abort_all_requests, request.weight_version)
        out = await tm.update_weights_from_disk(obj)
        return JSONResponse(dataclasses.asdict(out), status_code=200 if out.success else 400)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: UpdateWeightsFromTensorRequest) -> Response:
        """SGLang's route, with safetensors (base64) in place of its pickles: named tensors in the
        checkpoint's names, any subset of the model's. Body {success, message}; 400 when refused.
        The base64 ends here: the scheduler gets the files' bytes (io_struct carries them raw)."""
        try:
            files = _base64_entries(request.serialized_named_tensors)
        except ValueError as e:
            return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, status_code=400)
        request.serialized_named_tensors = []  # (the text is no longer needed while the update waits its turn)
        obj = UpdateWeightsFromTensorReqInput(files, request.load_format, request.flush_cache, request.abort_all_requests,
                                              request.weight_version)  # fmt: skip
        del files
        out = await tm.update_weights_from_tensor(obj)
        return JSONResponse(dataclasses.asdict(out), status_code=200 if out.success else 400)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])  # (SGLang's methods)
    async def get_weights_by_name(request: GetWeightsByNameRequest) -> Response:
        """SGLang's: the parameter's first truncate_size rows (a vector's values) as a JSON list."""
        out = await tm.get_weights_by_name(GetWeightsByNameReqInput(request.name, request.truncate_size))
        if out.parameter is None:
            return create_error_response(out.message or "Get parameter by name failed", param="name")
        return JSONResponse(out.parameter)

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        """SGLang's: the served weights' version (--weight-version, or the last update's weight_version)."""
        return JSONResponse({"weight_version": tm.weight_version})

    @app.post("/abort_request")
    async def abort_request(raw_request: Request) -> Response:
        try:
            body: Dict[str, Any] = await raw_request.json()
        except (ValueError, RecursionError):  # (RecursionError: JSON nested thousands deep)
            return create_error_response("The request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str):
            return create_error_response("Expected {\"rid\": str, \"abort_all\": bool}", param="rid")
        if not isinstance(body.get("abort_all", False), bool):  # "false" must not abort everyone
            return create_error_response("`abort_all` must be true or false", param="abort_all")
        tm.abort_request(rid=body.get("rid", ""), abort_all=body.get("abort_all", False))
        return Response(status_code=200)


def _base64_entries(serialized: List[str]) -> List[bytes]:
    """/update_weights_from_tensor's entries (weight_update.serialize_named_tensors' base64 text) ->
    the safetensors files' bytes. ValueError names the entry that is not base64."""
    files = []
    for i, text in enumerate(serialized):
        try:
            files.append(base64.b64decode(text, validate=True))
        except binascii.Error as e:
            raise ValueError(f"serialized_named_tensors[{i}] is not base64 text ({e})") from None
    return files


def _lora_update_response(out: LoRAUpdateOutput) -> Response:
    """A load's or an unload's answer: SGLang's LoRAUpdateOutput as JSON with 200, or the OpenAI
    error body with 400 (SGLang sends the output itself with 400) saying why."""
    if not out.success:
        return create_error_response(out.error_message or "The LoRA adapter update failed")
    return JSONResponse(dataclasses.asdict(out))


async def _profile_response(reply: Any, route: str) -> Response:
    """A ProfileReqOutput as HTTP: its message as text (SGLang answers "Start profiling." in
    text), or the OpenAI error body with 400 when the scheduler refused."""
    try:
        out = await reply
    except asyncio.TimeoutError:
        return create_error_response(f"The scheduler did not answer {route} in time; see the server log", 503,
                                     err_type="ServiceUnavailableError")  # fmt: skip
    if not out.success:
        return create_error_response(out.message)
    return Response(out.message + "\n", media_type="text/plain")


async def _native_generate(tm: TokenizerManager, request: GenerateRequest, raw_request: Request) -> Response:
    """SGLang's /generate: {"text", "output_ids", "meta_info"} (a list for batches).

    A stream's chunks are cumulative, as SGLang's: each carries all text, ids, logprobs and
    hidden states so far, and the last equals the non-stream answer; with
    --incremental-streaming-output, what each adds (the TokenizerManager's own dicts; SGLang sends
    the whole hidden-state list in every chunk there too).
    """
    obj = GenerateReqInput(
        text=request.text,
        input_ids=request.input_ids,
        sampling_params=request.sampling_params,
        rid=request.rid,
        return_logprob=request.return_logprob,
        logprob_start_len=request.logprob_start_len,
        top_logprobs_num=request.top_logprobs_num,
        return_text_in_logprobs=request.return_text_in_logprobs,
        token_ids_logprob=request.token_ids_logprob,
        return_hidden_states=request.return_hidden_states,
        stream=request.stream,
        priority=request.priority,
        custom_logit_processor=request.custom_logit_processor,
        lora_path=request.lora_path,
        extra_key=request.extra_key,
    )
    try:
        gen = tm.generate_request(obj, raw_request)
        if not request.stream:
            outs = sorted([out async for out in gen], key=lambda o: o.get("index", 0))
            content = outs[0] if obj.is_single and len(outs) == 1 else outs
            if not any("hidden_states" in out["meta_info"] for out in outs):
                return JSONResponse(content)
            # float32 rows -> JSON numbers: ~1 s for a 2,000 x 1,024 prompt entry, off the event loop
            body = await off_loop_if_large(lambda: answer_json(content), answer_numbers(content))
            return Response(content=body, media_type="application/json")
        first = await gen.__anext__()  # errors before the first token are real HTTP errors
    except ReqAbortedError as e:  # (param: the field, by /generate's own names, where the engine named one)
        return create_error_response(e.message, e.status_code, param=e.param)
    except ValueError as e:
        return create_error_response(str(e), param=error_param(e))

    incremental = tm.server_args.incremental_streaming_output

    async def events() -> AsyncIterator[Union[str, bytes]]:
        texts: Dict[int, str] = {}
        ids: Dict[int, List[int]] = {}
        logprobs: Dict[int, Dict[str, List[Any]]] = {}
        hidden_states: Dict[int, List[Any]] = {}
        written = StreamedEntries()  # (each entry's JSON once: a cumulative chunk resends them all)
        try:
            async for out in prepend(first, gen):
                if incremental:
                    if "hidden_states" in out["meta_info"]:
                        yield await written.chunk_json(out, out.get("index", 0), cumulative=False)
                    else:
                        yield sse_data(out)
                    continue
                index = out.get("index", 0)
                texts[index] = texts.get(index, "") + out["text"]
                ids.setdefault(index, []).extend(out["output_ids"])
                so_far = logprobs.setdefault(index, {key: [] for key in LOGPROB_META_KEYS})
                meta = dict(out["meta_info"])
                for key in LOGPROB_META_KEYS:
                    so_far[key].extend(meta.get(key, ()))
                    meta[key] = list(so_far[key])
                chunk = {**out, "text": texts[index], "output_ids": ids[index], "meta_info": meta}
                if "hidden_states" in meta:  # (only a prompt that asked has them)
                    entries = hidden_states.setdefault(index, [])
                    entries.extend(meta["hidden_states"])
                    meta["hidden_states"] = list(entries)
                    yield await written.chunk_json(chunk, index, cumulative=True)
                else:
                    yield sse_data(chunk)
        except ValueError as e:  # after the headers: an error event, then [DONE] as usual (SGLang)
            yield sse_data(error_body(str(e), param=error_param(e)))
        finally:
            await gen.aclose()
        yield sse_data("[DONE]")

    return sse_response(events())


async def _native_encode(tm: TokenizerManager, request: EncodeRequest, raw_request: Request) -> Response:
    """SGLang's /encode: {"embedding", "meta_info"} for one prompt, a list of them for a batch."""
    obj = EmbeddingReqInput(text=request.text, input_ids=request.input_ids, rid=request.rid, dimensions=request.dimensions)
    try:
        outs = sorted([out async for out in tm.generate_request(obj, raw_request)], key=lambda o: o.get("index", 0))
        if obj.is_single:
            return JSONResponse(outs[0])
        # a batch: encoded off the event loop, one embedding at a time (as /v1/embeddings' answer)
        body = await asyncio.to_thread(json_list_in_pieces, outs)
        return Response(content=body.encode(), media_type="application/json")
    except Exception as e:
        return handler_error_response(e, error_param(e))  # (/encode's fields are /generate's: text, input_ids)


# --------------------------------------------------------------------------- launch
def _spawn_children(server_args: ServerArgs, port_args: PortArgs) -> Tuple[List[mp.Process], List[Any]]:
    """The scheduler (rank 0 with --tp-size N), ranks 1..N-1, the detokenizer; each with its ready pipe.

    (SGLang's _launch_subprocesses: one scheduler process per TP rank.) The ranks meet at
    port_args.tp_store_path; only rank 0 opens the sockets."""
    from minisgl.managers.detokenizer_manager import run_detokenizer_process
    from minisgl.managers.scheduler import run_scheduler_process
    from minisgl.managers.scheduler import run_tp_follower_process

    ctx = mp.get_context("spawn")
    children: List[Tuple[str, Any, Tuple[Any, ...]]] = [("scheduler", run_scheduler_process, (server_args, port_args))]
    for rank in range(1, server_args.tp_size):
        children.append((f"scheduler_tp{rank}", run_tp_follower_process, (server_args, rank, port_args.tp_store_path)))
    children.append(("detokenizer", run_detokenizer_process, (server_args, port_args)))
    procs, readers = [], []
    for name, target, args in children:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, writer), name=f"minisgl-{name}", daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
        print(f"minisgl {name} pid={proc.pid}", flush=True)  # lets operators (and tests) find each process
    return procs, readers


def _wait_ready(procs: List[mp.Process], readers: List[Any], timeout: float = READY_TIMEOUT_S) -> List[Dict[str, Any]]:
    """Each child's ready message, in the children's order; raise RuntimeError with a failure's
    own message. All are watched at once: with --tp-size N, a rank that fails makes the others
    fail after it (their rendezvous or collective breaks), and its message is the one to see
    (_first_failure)."""
    infos: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(infos) < len(procs):
        for i, (proc, reader) in enumerate(zip(procs, readers)):
            if i in infos:
                continue
            info, failure = _start_up_status(proc, reader)
            if failure is not None:
                raise RuntimeError(_first_failure(procs, readers, infos, i, failure))
            if info is not None:
                infos[i] = info
        if len(infos) < len(procs):
            if time.monotonic() > deadline:
                waiting = ", ".join(p.name for i, p in enumerate(procs) if i not in infos)
                raise RuntimeError(f"{waiting} not ready after {timeout:.0f} s")
            time.sleep(0.05)
    return [infos[i] for i in range(len(procs))]


class _StartFailure(NamedTuple):
    text: str  # what the server says
    failed_at: Optional[float]  # the child's time.time() at its failure (tp_process.start_up_reported); None: it died
    refused: bool  # a ValueError: a setting or a model minisgl refuses (every rank alike)


def _start_up_status(proc: mp.Process, reader: Any) -> Tuple[Optional[Dict[str, Any]], Optional[_StartFailure]]:
    """(its ready message, None), (None, how it failed), or (None, None) while it is starting."""
    if reader.poll():
        try:
            info = reader.recv()
        except EOFError:
            return None, _StartFailure(f"{proc.name} closed its pipe before it was ready (exit code {proc.exitcode})", None, False)
        if info.get("status") != "ready":
            message = str(info.get("message", info))
            return None, _StartFailure(f"{proc.name} failed to start: {message}", info.get("failed_at"), message.startswith("ValueError:"))
        return info, None
    if not proc.is_alive() and not reader.poll():
        return None, _StartFailure(f"{proc.name} exited with code {proc.exitcode} before it was ready", None, False)
    return None, None


def _first_failure(procs: List[mp.Process], readers: List[Any], ready: Dict[int, Any], i: int, failure: _StartFailure) -> str:
    """What to report when child i failed to start: with --tp-size N, another scheduler rank's own
    failure when it came first (or that rank died), waited for up to FOLLOWER_FAILURE_WAIT_S: the
    errors a rank's failure causes on the others (gloo's "Connection closed by peer") come after
    it, but may be read first. A setting every rank refuses (a ValueError) is said at once."""
    others = [j for j, p in enumerate(procs) if p.name.startswith("minisgl-scheduler") and j != i and j not in ready]
    if not procs[i].name.startswith("minisgl-scheduler") or failure.refused or failure.failed_at is None:
        return failure.text
    deadline = time.monotonic() + FOLLOWER_FAILURE_WAIT_S
    while others and time.monotonic() < deadline:
        for j in list(others):
            _, theirs = _start_up_status(procs[j], readers[j])
            if theirs is not None:
                if theirs.failed_at is None or theirs.failed_at < failure.failed_at:
                    return theirs.text
                others.remove(j)  # (it failed after: an echo)
        time.sleep(0.05)
    return failure.text


def server_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 host in brackets (http://[::1]:30000)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bind_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket ourselves, before the model loads: a port in use fails at once,
    not after minutes of loading, and with port 0 the kernel picks and we know the real port.
    It listens only once the server is ready (`_serve`): a client connecting while the model
    loads is refused, not left hanging in the backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise OSError(f"cannot resolve --host {host}: {e.strerror}") from e
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:  # an address of another machine
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; --host must be an address of this "
                          "machine (0.0.0.0 for all of them)") from e  # fmt: skip
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port (0 picks a free one)") from e
    sock.set_inheritable(True)
    return sock


def _terminate(procs: List[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)


async def _serve(
    server_args: ServerArgs, port_args: PortArgs, procs: List[mp.Process], sched_info: Dict[str, Any], tokenizer: Any,
    sock: socket.socket,
) -> int:  # fmt: skip
    """Run uvicorn + the TokenizerManager until a signal (exit 0) or a dead child (exit 1)."""
    import uvicorn

    tm = TokenizerManager(
        server_args, port_args, tokenizer, int(sched_info["context_len"]), int(sched_info["vocab_size"]),
        max_req_input_len=int(sched_info["max_req_input_len"]),
        default_sampling_params=sched_info.get("default_sampling_params"),
        hidden_size=sched_info.get("hidden_size"), is_matryoshka=bool(sched_info.get("is_matryoshka")),
        matryoshka_dimensions=sched_info.get("matryoshka_dimensions"),
    )  # fmt: skip
    if tm.default_sampling_params:
        logger.info("Using default chat sampling params from model generation config: %s", tm.default_sampling_params)
    handle_loop = asyncio.get_running_loop().create_task(tm.handle_loop())

    def is_healthy() -> bool:
        return all(p.is_alive() for p in procs) and not handle_loop.done()

    app = create_app(server_args, tm, is_healthy, port_args)
    host, port = sock.getsockname()[:2]
    try:
        sock.listen(2048)
    except OSError as e:  # another server bound the same port (SO_REUSEADDR) and listened first
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port (0 picks a free one)") from e
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = uvicorn.Server(config)
    ready_line = f"minisgl server ready at {server_url(host, port)}"
    monitor = asyncio.get_running_loop().create_task(_monitor(server, procs, handle_loop, tm, ready_line, sched_info))
    try:
        await server.serve(sockets=[sock])
    finally:
        monitor.cancel()
        if is_healthy():  # a requested shutdown: a profile still recording writes its trace first
            await _stop_profile_before_exit(tm)
        handle_loop.cancel()
        tm.close()
    return monitor.result() if monitor.done() and not monitor.cancelled() else 0


async def _monitor(
    server: Any, procs: List[mp.Process], handle_loop: "asyncio.Task[None]", tm: TokenizerManager, ready_line: str,
    sched_info: Dict[str, Any],
) -> int:  # fmt: skip
    """Announce readiness, watch the children every 0.2 s, and end what is in flight when the
    server stops. Returns the exit code: 1 if a child (or the handle loop) died, else 0."""
    announced = False
    while not server.should_exit:
        if not announced and server.started:
            announced = True
            print(ready_line, flush=True)
            logger.info("The server is fired up and ready to roll! (max_total_num_tokens=%s)", sched_info.get("max_total_num_tokens"))
        dead = [p for p in procs if not p.is_alive()]
        if dead or handle_loop.done():
            what = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead) or "the TokenizerManager loop"
            logger.error("%s died; shutting the server down", what)
            # nothing will answer the requests in flight: end them here, so that each
            # handler answers its client within uvicorn's grace period
            tm.fail_all_requests(f"The server is shutting down: {what} died")
            server.should_exit = True
            return 1
        await asyncio.sleep(0.2)
    # A requested shutdown (SIGTERM, Ctrl-C): the scheduler is still up, so abort what is in
    # flight and let each request end as an abort (streams with their last chunk and [DONE])
    # within uvicorn's grace period, rather than be cancelled into a 500.
    tm.abort_request(abort_all=True)
    # A step can outlast that grace period (a long prefill on a CPU): what the scheduler has
    # not ended by then ends here.
    deadline = time.monotonic() + SHUTDOWN_ABORT_WAIT_S
    while tm.rid_to_state and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    tm.fail_all_requests("The server is shutting down")
    return 0


async def _stop_profile_before_exit(tm: TokenizerManager) -> None:
    """As Engine.shutdown does: a /start_profile without its /stop_profile would otherwise leave no
    trace at all. Bounded: a very long profile may take longer to write than a shutdown may wait."""
    try:
        out = await asyncio.wait_for(tm.stop_profile(), timeout=SHUTDOWN_PROFILE_WAIT_S)
    except asyncio.TimeoutError:
        logger.warning("The running profile's trace was not written within %ss of the shutdown", SHUTDOWN_PROFILE_WAIT_S)
        return
    if out.success:  # ("not in progress" otherwise: nothing to say)
        logger.info("Shutting down while profiling: %s", out.message)


class _ShutdownRequested(Exception):
    """SIGINT or SIGTERM (SIGHUP arrives as one): a clean, requested shutdown (exit code 0)."""


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _ShutdownRequested(signal.Signals(signum).name)


def _run_event_loop(main: Any) -> int:
    """Run the server's event loop: uvloop where installed (as SGLang does), else asyncio's.

    Every streamed token is a socket write and a few callbacks in this process; uvloop's
    libuv loop does them for less CPU, which on a 2-core machine is CPU the scheduler's
    matmul threads get back.
    """
    try:
        import uvloop
    except ImportError:  # e.g. Windows, where uvloop does not build
        return asyncio.run(main)
    return uvloop.run(main)


def launch_server(server_args: ServerArgs) -> None:
    """Start the three processes and serve until stopped; exits non-zero if a process dies."""
    server_args = server_args if server_args.is_resolved else resolve_server_args(server_args)
    configure_logging(server_args.log_level, prefix="HTTP")
    try:
        port_args = PortArgs.init_new()
    except ValueError as e:  # TMPDIR too long for a socket path
        print(f"minisgl server failed: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    # SIGINT / SIGTERM unwind through the finally below (uvicorn captures them while it
    # serves, shuts down gracefully, then re-raises them into these handlers). SIGHUP (the
    # terminal closed) becomes a SIGTERM, which uvicorn knows: the same graceful way out.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_shutdown)
    # (not under nohup, whose ignored SIGHUP is the point: the server outlives its terminal)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    try:
        sock = _bind_socket(server_args.host, server_args.port)
    except OSError as e:
        logger.error("Server failed: %s", e)
        print(f"minisgl server failed: {e}", file=sys.stderr, flush=True)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
        sys.exit(1)
    procs, readers = _spawn_children(server_args, port_args)
    exit_code = 1
    try:
        # the children first: a model that cannot load fails there with the clearest message
        # (the scheduler's), before this process tries (and retries) the same path
        sched_info = _wait_ready(procs, readers)[0]  # (rank 0's: every rank's limits are the same)
        tokenizer = get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        if server_args.chat_template is not None:
            load_chat_template(tokenizer, server_args.chat_template)
        exit_code = _run_event_loop(_serve(server_args, port_args, procs, sched_info, tokenizer, sock))
    except _ShutdownRequested:
        logger.info("Shutdown requested; stopping the scheduler and the detokenizer")
        exit_code = 0
    except (RuntimeError, ValueError, OSError) as e:
        logger.error("Server failed: %s", e)
        print(f"minisgl server failed: {e}", file=sys.stderr, flush=True)
    finally:
        _terminate(procs)
        sock.close()
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
    sys.exit(exit_code)
