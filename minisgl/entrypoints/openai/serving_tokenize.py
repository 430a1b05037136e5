"""/v1/tokenize and /v1/detokenize (stage 1, SGLang's serving_tokenize.py; also at /tokenize
and /detokenize). In: TokenizeRequest / DetokenizeRequest. Out: `{"tokens", "count",
"max_model_len"}` / `{"text"}`.

Where it sits: beside the generation routes, on the same tokenizer the TokenizerManager
encodes prompts with, so a client counts exactly the tokens a completion's prompt will take
(`add_special_tokens` defaults to what /v1/completions does with a text prompt). Nothing
reaches the scheduler. `max_model_len` is the served context length (/v1/models'), where
SGLang reports the tokenizer's `model_max_length`, often a placeholder like 1e30.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, List, Union

from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from minisgl.entrypoints.openai.serving_base import create_error_response, unknown_model_response
from minisgl.managers import tokenization
from minisgl.managers.tokenizer_manager import TOKENIZE_OFF_LOOP_CHARS, TokenizerManager


async def _off_the_loop_if_big(size: int, fn: Callable[[], Any]) -> Any:
    """Run fn on the event loop when small, else in a worker thread (a 10 MB text takes seconds
    to tokenize, and on the loop every other client's stream would stop meanwhile). `size` is
    characters to encode, or ids to decode (an id decodes in about half the time a character
    encodes, measured: the same bound errs on the side of the loop)."""
    if size <= TOKENIZE_OFF_LOOP_CHARS:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def tokenize(tm: TokenizerManager, request: TokenizeRequest) -> Response:
    if request.model is not None and (unknown := unknown_model_response(request.model, tm.model_name)) is not None:
        return unknown
    texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    try:
        for text in texts:
            tokenization.check_text(text)
    except ValueError as e:
        return create_error_response(str(e))
    chars = sum(len(t) for t in texts)
    ids = await _off_the_loop_if_big(chars, lambda: tokenization.encode_texts(tm.tokenizer, texts, request.add_special_tokens))
    tokens: Union[List[int], List[List[int]]] = ids[0] if isinstance(request.prompt, str) else ids
    count: Union[int, List[int]] = len(ids[0]) if isinstance(request.prompt, str) else [len(row) for row in ids]
    return JSONResponse({"tokens": tokens, "count": count, "max_model_len": tm.context_len})


async def detokenize(tm: TokenizerManager, request: DetokenizeRequest) -> Response:
    if request.model is not None and (unknown := unknown_model_response(request.model, tm.model_name)) is not None:
        return unknown
    single = not request.tokens or not isinstance(request.tokens[0], list)
    rows: List[List[int]] = [request.tokens] if single else request.tokens  # type: ignore[list-item]
    try:
        for row in rows:
            tokenization.validate_input_ids(row, tm.vocab_size, "tokens")
    except ValueError as e:
        return create_error_response(str(e), param="tokens")
    size = sum(len(row) for row in rows)
    texts = await _off_the_loop_if_big(
        size, lambda: [tm.tokenizer.decode(row, skip_special_tokens=request.skip_special_tokens) for row in rows]
    )
    return JSONResponse({"text": texts[0] if single else texts})
