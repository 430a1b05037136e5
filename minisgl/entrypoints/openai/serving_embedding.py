"""OpenAIServingEmbedding (stage 1, SGLang's serving_embedding.py). In: EmbeddingRequest.
Out: OpenAI's embedding list `{"object": "list", "data": [...], "model", "usage"}`.

Where it sits: the /v1/embeddings route hands the pydantic request to `handle_request`, which
checks the input (SGLang's messages), builds an `EmbeddingReqInput` (a list of texts or of
token-id lists is a batch) and collects the TokenizerManager's answers, one per input, in
input order (`index`). Embeddings do not stream. With `encoding_format: "base64"` each
embedding is the base64 of its little-endian float32 bytes, as OpenAI's: what the openai client
asks for when its caller names no format, and decodes back to the same floats.
`usage.prompt_tokens` sums the inputs' tokens; `total_tokens` is the same number (no output).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from typing import Any, Dict, List, Optional

from fastapi import Request
from fastapi.responses import Response

from minisgl.entrypoints.openai.protocol import EmbeddingObject, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from minisgl.entrypoints.openai.serving_base import create_error_response, handler_error_response, unknown_model_response
from minisgl.managers.io_struct import EmbeddingReqInput
from minisgl.managers.tokenizer_manager import EMBEDDING_ON_GENERATION_SERVER, TokenizerManager

logger = logging.getLogger("minisgl.serving")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's; each answer is inputs x hidden floats, built on the HTTP process


def encode_base64(embedding: List[float]) -> str:
    """OpenAI's base64 form: the little-endian float32 bytes of the vector, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def _dumps(value: Any) -> str:  # (compact, as JSONResponse writes)
    return json.dumps(value, separators=(",", ":"))


def json_list_in_pieces(items: List[Any]) -> str:
    """A JSON list encoded one item at a time. Run in a worker thread (asyncio.to_thread), it lets
    the event loop take the GIL between items: one json.dumps of 2,048 embeddings of 1,024 floats
    held it for over a second, and every other client waited."""
    return "[" + ",".join(_dumps(item) for item in items) + "]"


def validate_embedding_input(value: Any) -> Optional[str]:
    """SGLang's checks of an embedding input (its messages): no empty or whitespace-only text,
    no empty list, no empty token-id list. Ids outside the vocabulary are the tokenizer's check."""
    if not value:
        return "Input cannot be empty"
    if isinstance(value, str):
        return "Input cannot be empty or whitespace only" if not value.strip() else None
    for i, item in enumerate(value):
        if isinstance(item, str) and not item.strip():
            return f"Input at index {i} cannot be empty or whitespace only"
        if isinstance(item, list) and not item:
            return f"Input at index {i} cannot be empty"
    return None


class OpenAIServingEmbedding:
    """handle_request: check -> EmbeddingReqInput -> collect -> the embedding list."""

    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tokenizer_manager = tokenizer_manager

    async def handle_request(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        tm = self.tokenizer_manager
        unknown = unknown_model_response(request.model, tm.model_name)
        if unknown is not None:
            return unknown
        if not tm.is_embedding:  # (the TokenizerManager refuses it too; said first, before any other check)
            return create_error_response(EMBEDDING_ON_GENERATION_SERVER)
        error = validate_embedding_input(request.input)
        if error is None and isinstance(request.input, list) and isinstance(request.input[0], (str, list)) and len(request.input) > MAX_EMBEDDING_INPUTS:
            error = f"At most {MAX_EMBEDDING_INPUTS} inputs per request (OpenAI's limit), got {len(request.input)}: split it"
        if error is not None:
            return create_error_response(error, param="input")
        if request.user is not None and tm.server_args.log_requests:
            logger.info("Embedding request from user=%r: %s input(s)", request.user, 1 if isinstance(request.input, str) else len(request.input))
        try:
            outs = [out async for out in tm.generate_request(self._convert_to_internal_request(request), raw_request)]
            outs.sort(key=lambda out: out.get("index", 0))
            # built and encoded in a worker thread, one embedding at a time: the event loop (every
            # other client's stream) gets the GIL between them; 2,048 vectors of 1,024 floats made
            # one json.dumps of ~45 MB that held it for over a second
            body = await asyncio.to_thread(self._response_body, outs, request)
            return Response(content=body, media_type="application/json")
        except Exception as e:
            return handler_error_response(e)

    @staticmethod
    def _convert_to_internal_request(request: EmbeddingRequest) -> EmbeddingReqInput:
        """A string or a list of strings is text; a list of ints or of int lists is input_ids."""
        value = request.input
        is_ids = isinstance(value, list) and isinstance(value[0], (int, list))
        return EmbeddingReqInput(
            text=None if is_ids else value,  # type: ignore[arg-type]
            input_ids=value if is_ids else None,  # type: ignore[arg-type]
            dimensions=request.dimensions,
        )

    @staticmethod
    def _response_body(outs: List[Dict[str, Any]], request: EmbeddingRequest) -> bytes:
        """EmbeddingResponse as JSON, each EmbeddingObject encoded on its own (see handle_request)."""
        response = OpenAIServingEmbedding._build_embedding_response(outs, request)
        items = json_list_in_pieces([item.model_dump() for item in response.data])
        return (f'{{"object":"list","data":{items},"model":{_dumps(response.model)},'
                f'"usage":{_dumps(response.usage.model_dump())}}}').encode()  # fmt: skip

    @staticmethod
    def _build_embedding_response(outs: List[Dict[str, Any]], request: EmbeddingRequest) -> EmbeddingResponse:
        data: List[EmbeddingObject] = []
        prompt_tokens = 0
        for index, out in enumerate(outs):
            embedding = out["embedding"]
            if embedding is None:  # ended without one: aborted (e.g. /abort_request) before its prompt was computed
                reason = out["meta_info"].get("finish_reason") or {}
                raise ValueError(f"The embedding of input {index} was not computed: {reason.get('message') or 'aborted'}")
            vector = encode_base64(embedding) if request.encoding_format == "base64" else embedding
            data.append(EmbeddingObject(embedding=vector, index=index))
            prompt_tokens += out["meta_info"]["prompt_tokens"]
        usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return EmbeddingResponse(data=data, model=request.model, usage=usage)
