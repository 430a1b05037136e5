"""Scoring (stage 2, SGLang's tokenizer_manager_score_mixin.py). In: a query, items, label token ids.
Out: per item, the probabilities of the labels as the next token (`ScoreResult`).

Where it sits: `/v1/score` (serving_score.py) calls `TokenizerManager.score_request` (this mixin),
and `Engine.score` calls the same two functions below; neither adds a path of its own. A call is
an ordinary batch request: `build_score_request` turns it into one `GenerateReqInput` with one
prompt per item (query + item, or item + query with `item_first`), which takes the generation
path as any /generate batch does (checks, tokenization, the scheduler's batches, the radix cache),
and `scores_from_outputs` reads each prompt's `output_token_ids_logprobs[0]`: the log-probabilities
of the labels at the position after the prompt.

    score_request(query, items, label_token_ids, apply_softmax, item_first)
        --build_score_request--> GenerateReqInput(text or input_ids: one prompt per item,
                                 max_new_tokens 1, return_logprob, token_ids_logprob=labels)
        --generate_request--> one result per item --scores_from_outputs--> ScoreResult

Why `max_new_tokens: 1` where SGLang sends 0: SGLang's prefill samples a token for a request that
asked for none and reports that position's logprobs (then drops the token); minisgl's
`max_new_tokens: 0` reports no output position at all (docs/scheduler.md). With 1 the prefill
computes the same row, the request ends right after it (no decode pass), and the sampled token
is dropped here. `temperature` is 0 (greedy): the sampler maps it to temperature 1 with top_k 1
(SamplingParams.normalize), and takes the logprobs unscaled, before any top-k truncation
(layers/sampler.py), so they are the model's own. Greedy also keeps the scoring out of the
ModelRunner's generator: a batch of score requests is all greedy, an argmax that draws nothing,
so a seeded Engine's sampled generations are the same with or without a score call between
them (at temperature 1 each score batch drew from it). SGLang's multi-item scoring (`--multi-item-scoring-delimiter`: all items
in one sequence under a custom attention mask) is not built (server_args.SGLANG_OPTIONS_REFUSED).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from minisgl.managers.io_struct import MAX_SUB_REQUESTS, MAX_TOKEN_IDS_LOGPROB, GenerateReqInput
from minisgl.utils import ParamError

# one output position, greedy (the model's own logprobs, nothing drawn); see the module docstring
SCORE_SAMPLING_PARAMS: Dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
# /generate's names of the fields an error from the generation path is about -> /v1/score's
# (a prompt, query + item, too long is about the items; the labels are label_token_ids)
ROUTE_PARAMS = {"text": "items", "input_ids": "items", "max_new_tokens": "items", "token_ids_logprob": "label_token_ids"}
# SGLang's message for a query/items pair that is neither text + text nor ids + ids
INVALID_COMBINATION = "Invalid combination of query/items types for score_request."


@dataclass(frozen=True)
class ScoreResult:
    """SGLang's ScoreResult (scores, prompt_tokens), plus the prompt tokens found in the radix cache."""

    scores: List[List[float]]  # one list per item, in the order of label_token_ids
    prompt_tokens: int  # all items' prompts together
    cached_tokens: int  # of those, the tokens a radix match covered (not computed again)


def route_param(param: Optional[str]) -> Optional[str]:
    """An error's field by /v1/score's names (the route's and Engine.score's): the generation
    path's names mapped by ROUTE_PARAMS; the score checks' own names pass as they are. None
    (an error about no one field) stays None."""
    return ROUTE_PARAMS.get(param, param) if param is not None else None


def score_param_error(e: ParamError) -> ParamError:
    """The generation path's ParamError with its field renamed by route_param (Engine.score's: the
    same names the server's 400 gives), its message as it is."""
    return ParamError(str(e), ROUTE_PARAMS.get(e.param, e.param))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)  # (a bool is no token id)


def check_label_token_ids(label_token_ids: Any, vocab_size: int, max_labels: Optional[int] = None) -> List[int]:
    """The labels: a non-empty list of ids inside the vocabulary (SGLang's out-of-vocabulary message).
    SGLang scores an empty list as empty lists; here it is refused, as it asks for nothing."""
    if label_token_ids is None:
        raise ParamError("label_token_ids must be provided", "label_token_ids")
    if not _is_ids(label_token_ids):
        raise ParamError(f"label_token_ids must be a list of token ids (ints), got {label_token_ids!r:.200}", "label_token_ids")
    if not label_token_ids:
        raise ParamError("label_token_ids must hold at least one token id: the tokens whose probabilities to return", "label_token_ids")
    if max_labels is not None and len(label_token_ids) > max_labels:
        raise ParamError(f"label_token_ids takes at most {max_labels} ids, got {len(label_token_ids)}", "label_token_ids")
    for token_id in label_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ParamError(f"Token ID {token_id} is out of vocabulary (vocab size: {vocab_size})", "label_token_ids")
    return label_token_ids


def _check_ids_in_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise ParamError(f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})", param)


def build_score_request(
    query: Any, items: Any, label_token_ids: Any, item_first: Any, vocab_size: int,
    max_labels: Optional[int] = None, max_items: Optional[int] = None,
) -> Optional[GenerateReqInput]:  # fmt: skip
    """The batch request that scores `items` (None when there are none: SGLang answers `[]`).

    Text: `query` a string, `items` a string (one item) or a list of strings; each prompt is the
    two strings joined as they are (`f"{query}{item}"`, SGLang's), tokenized whole. Token ids:
    `query` a list of ids, `items` a list of id lists; each prompt is the two lists joined. Any
    other pair (a None query, text with ids) is a ParamError naming the field to change."""
    labels = check_label_token_ids(label_token_ids, vocab_size, max_labels)
    if type(item_first) is not bool:
        raise ParamError(f"item_first must be true or false, got {item_first!r:.100}", "item_first")
    if items is None:
        raise ParamError("items must be provided", "items")
    if not items:  # "" or []: nothing to score (SGLang's answer, before it reads the query)
        return None
    if max_items is not None and isinstance(items, list) and len(items) > max_items:
        raise ParamError(f"This request has {len(items)} items; at most {max_items} per request: split it", "items")
    text_items = isinstance(items, str) or (isinstance(items, list) and all(isinstance(i, str) for i in items))
    id_items = isinstance(items, list) and all(_is_ids(i) for i in items)
    if isinstance(query, str) and text_items:
        item_list = [items] if isinstance(items, str) else items
        prompts = [item + query if item_first else query + item for item in item_list]
        return _score_batch(labels, text=prompts)
    if _is_ids(query) and id_items:
        _check_ids_in_vocab(query, vocab_size, "query")
        for item in items:
            _check_ids_in_vocab(item, vocab_size, "items")
        return _score_batch(labels, input_ids=[item + query if item_first else query + item for item in items])
    # which field to change: a query that is neither form, else the items that do not match it
    query_ok = isinstance(query, str) or _is_ids(query)
    raise ParamError(
        f"{INVALID_COMBINATION} Send a text query (a string) with text items (a string or a list of strings), "
        f"or a token-id query (a list of ints) with token-id items (a list of lists of ints); got query: "
        f"{_describe(query)}, items: {_describe(items)}",
        "items" if query_ok else "query",
    )


def _score_batch(labels: List[int], text: Optional[List[str]] = None, input_ids: Optional[List[List[int]]] = None) -> GenerateReqInput:
    return GenerateReqInput(
        text=text, input_ids=input_ids, sampling_params=dict(SCORE_SAMPLING_PARAMS),
        return_logprob=True, logprob_start_len=-1, token_ids_logprob=list(labels),
    )  # fmt: skip


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string"
    if _is_ids(value):
        return "a list of ints"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "a list of strings"
    if isinstance(value, list) and all(_is_ids(v) for v in value):
        return "a list of int lists"
    return f"a {type(value).__name__} that is neither form"


def label_scores(logprobs: Dict[int, float], label_token_ids: List[int], apply_softmax: bool) -> List[float]:
    """One item's scores in the order of the labels: softmax over the labels' logprobs (a softmax of
    their logits: the log-normaliser cancels), or each label's probability over the whole vocabulary."""
    values = [logprobs[t] for t in label_token_ids]  # (every label was asked for: token_ids_logprob)
    if not apply_softmax:
        return [math.exp(v) for v in values]
    top = max(values)  # (subtracted first: exp of a large logprob difference must not overflow)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def scores_from_outputs(outs: List[Dict[str, Any]], label_token_ids: List[int], apply_softmax: bool) -> ScoreResult:
    """The ScoreResult of a score batch's results (one per item, in item order)."""
    scores: List[List[float]] = []
    prompt_tokens = cached_tokens = 0
    for index, out in enumerate(outs):
        meta = out["meta_info"]
        positions = meta.get("output_token_ids_logprobs") or []
        if not positions or positions[0] is None:  # ended before its prefill (an abort): no score to give
            reason = meta.get("finish_reason") or {}
            raise ValueError(f"The score of item {index} was not computed: {reason.get('message') or 'aborted'}")
        logprobs = {token_id: logprob for logprob, token_id, _ in positions[0]}
        scores.append(label_scores(logprobs, label_token_ids, apply_softmax))
        prompt_tokens += meta.get("prompt_tokens", 0)
        cached_tokens += meta.get("cached_tokens", 0)
    return ScoreResult(scores=scores, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)


def check_apply_softmax(apply_softmax: Any) -> bool:
    if type(apply_softmax) is not bool:
        raise ParamError(f"apply_softmax must be true or false, got {apply_softmax!r:.100}", "apply_softmax")
    return apply_softmax


# the server's refusal on an --is-embedding server (the Engine's names is_embedding=True)
SCORE_ON_EMBEDDING_SERVER = (
    "This is an embedding server (started with --is-embedding): its model ends in a Pooler, not an LM head, so it "
    "has no next-token probabilities to score. /v1/score needs a server started without --is-embedding."
)


class TokenizerManagerScoreMixin:
    """SGLang's mixin: the TokenizerManager's `score_request`, over its own `generate_request`."""

    async def score_request(
        self, query: Any = None, items: Any = None, label_token_ids: Any = None, apply_softmax: Any = False,
        item_first: Any = False, request: Any = None,
    ) -> ScoreResult:  # fmt: skip
        """Score each item (SGLang's arguments): one batch of prompts through the scheduler."""
        tm: Any = self
        if tm.is_embedding:
            raise ValueError(SCORE_ON_EMBEDDING_SERVER)
        check_apply_softmax(apply_softmax)
        obj = build_score_request(
            query, items, label_token_ids, item_first, tm.vocab_size, max_labels=MAX_TOKEN_IDS_LOGPROB, max_items=MAX_SUB_REQUESTS
        )
        if obj is None:
            return ScoreResult(scores=[], prompt_tokens=0, cached_tokens=0)
        outs = [out async for out in tm.generate_request(obj, request)]
        outs.sort(key=lambda out: out.get("index", 0))
        return scores_from_outputs(outs, label_token_ids, apply_softmax)
