"""OpenAIServingScore (stage 1, SGLang's serving_score.py). In: ScoringRequest. Out: ScoringResponse
`{"scores": [[float]], "model", "usage", "object": "scoring"}`.

Where it sits: the /v1/score route hands the pydantic request to `handle_request`, which checks
the model name and the server's kind and calls `TokenizerManager.score_request`
(tokenizer_manager_score_mixin.py): one batch of prompts, one per item, through the generation
path. `usage.prompt_tokens` sums the items' prompts; nothing is generated for the client, so
`completion_tokens` is 0; `prompt_tokens_details.cached_tokens` is how much of them the radix
cache held (a query scored before is not computed again). Scoring does not stream (SGLang's).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from minisgl.entrypoints.openai.protocol import PromptTokensDetails, ScoringRequest, ScoringResponse, UsageInfo
from minisgl.entrypoints.openai.serving_base import create_error_response, error_param, handler_error_response, unknown_model_response
from minisgl.managers.tokenizer_manager import TokenizerManager
from minisgl.managers.tokenizer_manager_score_mixin import SCORE_ON_EMBEDDING_SERVER, route_param


class OpenAIServingScore:
    """handle_request: model and server checks -> score_request -> ScoringResponse."""

    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tokenizer_manager = tokenizer_manager

    async def handle_request(self, request: ScoringRequest, raw_request: Request) -> Response:
        tm = self.tokenizer_manager
        unknown = unknown_model_response(request.model, tm.model_name)
        if unknown is not None:
            return unknown
        if tm.is_embedding:  # (score_request refuses it too; said first, before the body's checks)
            return create_error_response(SCORE_ON_EMBEDDING_SERVER)
        try:
            result = await tm.score_request(
                query=request.query, items=request.items, label_token_ids=request.label_token_ids,
                apply_softmax=request.apply_softmax, item_first=request.item_first, request=raw_request,
            )  # fmt: skip
        except Exception as e:
            return handler_error_response(e, route_param(error_param(e)))
        usage = UsageInfo(
            prompt_tokens=result.prompt_tokens, completion_tokens=0, total_tokens=result.prompt_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
        )  # fmt: skip
        body = ScoringResponse(scores=result.scores, model=request.model, usage=usage)
        return Response(content=body.model_dump_json(), media_type="application/json")
