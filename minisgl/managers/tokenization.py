"""Tokenization of one request (seed 000: `_tokenize_one_request` + `_create_tokenized_object`).

Where it sits: GenerateReqInput (single) -> TokenizedGenerateReqInput, and EmbeddingReqInput
(single) -> TokenizedEmbeddingReqInput for an embedding model. The server's
TokenizerManager (async, HTTP process) and the in-process Engine both call these
functions, so a prompt becomes the same ids and the same verified SamplingParams on
either path.

- `tokenize_one_request` normalises the input form (text or input_ids) into ids.
- `create_tokenized_object` builds the scheduler's input: SamplingParams from SGLang's
  dict, `normalize(tokenizer)` (greedy mapping, stop strings) and `verify(vocab_size)`.
- `validate_context_length` is SGLang's context-length gate (`_validate_one_request`),
  with the scheduler's prompt limit too: a 400-style ValueError, or with
  `--allow-auto-truncate` a truncated prompt and a clamped max_new_tokens.
Bad input raises ValueError with a message that says what to change (HTTP 400 upstream).
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Union

from minisgl.managers.io_struct import (
    EmbeddingReqInput, GenerateReqInput, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput, check_logprob_args,
)  # fmt: skip
from minisgl.lora.lora_registry import LORA_NOT_ENABLED, LoRARegistry
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.utils import ParamError, lone_surrogate_at


def check_text(text: str) -> None:
    """A ValueError (a 400) for text with a lone surrogate, which no tokenizer can encode
    (it would raise a TypeError: a 500)."""
    at = lone_surrogate_at(text)
    if at is not None:
        raise ValueError(f"The prompt is not valid Unicode: character {at} is a lone surrogate ({text[at]!r}); send UTF-8 text")


def check_priority(priority: Any, enabled: bool) -> None:
    """A request's priority: an integer, and only where priority scheduling is on (SGLang's
    scheduler refuses it otherwise, with a 503; a request it cannot serve as asked is a 400 here)."""
    if priority is None:
        return
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r} ({type(priority).__name__})")
    if not enabled:
        raise ValueError(
            "priority needs priority scheduling, which this server does not run: start it with "
            "--enable-priority-scheduling (the Engine: enable_priority_scheduling=True), or send no priority"
        )


def check_custom_logit_processor(obj: GenerateReqInput, enabled: bool) -> None:
    """A normalized request's custom_logit_processor (one string per prompt, or None) and the
    custom_params it reads: a processor only where the server runs them, custom_params only with
    a processor (SGLang ignores them without one: here they are a 400, not silently dropped).
    Whether the string loads is the scheduler's check (it alone unpickles client code)."""
    processors = [obj.custom_logit_processor] if obj.is_single else obj.custom_logit_processor
    param_dicts = [obj.sampling_params] if obj.is_single else obj.sampling_params
    for processor, params in zip(processors or [], param_dicts or []):  # type: ignore[arg-type]
        if processor is not None and not isinstance(processor, str):
            raise ValueError(
                f"custom_logit_processor must be a string (CustomLogitProcessor.to_str()), got {type(processor).__name__}"
            )
        if processor is None and isinstance(params, dict) and params.get("custom_params") is not None:
            raise ValueError("custom_params are the parameters of a custom logit processor: send custom_logit_processor with them")
    if not enabled and any(p is not None for p in processors or []):  # type: ignore[union-attr]
        raise ValueError(
            "custom_logit_processor needs a server started with --enable-custom-logit-processor (the Engine: "
            "enable_custom_logit_processor=True). It is off by default because loading a processor unpickles "
            "it: it runs the code the client sends on the server. Turn it on only where every client may do that."
        )


# SGLang's message (tokenizer_manager.py, _validate_one_request), word for word
RETURN_HIDDEN_STATES_DISABLED = (
    "The server is not configured to return the hidden states. "
    "Please set `--enable-return-hidden-states` to enable this feature."
)


def check_return_hidden_states(obj: GenerateReqInput, enabled: bool, hint: str = "") -> None:
    """A normalized request's return_hidden_states (one bool, or one per prompt of a batch): booleans,
    and true only where the server returns them (SGLang's refusal, its message; `hint` adds how the
    caller turns it on, the Engine's argument)."""
    values = obj.return_hidden_states if isinstance(obj.return_hidden_states, list) else [obj.return_hidden_states]
    for value in values:
        if not isinstance(value, bool):
            raise ValueError(f"return_hidden_states must be true or false, got {value!r}")
    if any(values) and not enabled:
        raise ValueError(RETURN_HIDDEN_STATES_DISABLED + hint)


def resolve_lora_ids(obj: GenerateReqInput, registry: Optional[LoRARegistry]) -> None:
    """A normalized request's lora_path (one name, or one per prompt of a batch; None: the base model)
    -> obj.lora_id, the id each named adapter's load has now (SGLang's lora_registry.acquire).
    registry None: LoRA is off. Refused before anything is queued, naming the loaded adapters."""
    values = obj.lora_path if isinstance(obj.lora_path, list) else [obj.lora_path]
    ids: List[Optional[str]] = []
    for value in values:
        if value is None:
            ids.append(None)
            continue
        if not isinstance(value, str):
            raise ValueError(f"lora_path must be an adapter name (a string), got {value!r}")
        if registry is None:
            raise ValueError(LORA_NOT_ENABLED)
        ids.append(registry.lora_id_of(value))
    obj.lora_id = ids if isinstance(obj.lora_path, list) else ids[0]


MAX_EXTRA_KEY_CHARS = 1024  # a request's cache namespace, cache_salt + extra_key


def check_extra_key(obj: GenerateReqInput) -> None:
    """A normalized request's extra_key (one, or one per prompt of a batch; None or "": no key): a
    string. Refused before anything is queued; any string is a namespace of its own."""
    values = obj.extra_key if isinstance(obj.extra_key, list) else [obj.extra_key]
    for value in values:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"extra_key must be a string (the request's cache namespace), got {value!r}")
        if value is not None and len(value) > MAX_EXTRA_KEY_CHARS:
            # (a namespace is hashed on every tree lookup and held by the tree: a tenant id, not a document)
            raise ValueError(
                f"extra_key (with cache_salt on the OpenAI routes) has {len(value)} characters; at most "
                f"{MAX_EXTRA_KEY_CHARS}: send a shorter key (a hash of a long one)"
            )


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> List[int]:
    """Prompt text -> ids. Special tokens in the text (e.g. a rendered chat template) stay special;
    add_special_tokens adds the tokenizer's own around it (a Llama tokenizer's BOS: without it such
    a model continues a raw prompt noticeably worse), as SGLang's TokenizerManager does."""
    check_text(text)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_texts(tokenizer: Any, texts: List[str], add_special_tokens: bool = True) -> List[List[int]]:
    """Several prompts in one batched tokenizer call (the dynamic batch tokenizer's unit of work)."""
    if not texts:  # (a fast tokenizer raises IndexError on an empty batch)
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def validate_input_ids(input_ids: List[int], vocab_size: int, name: str = "input_ids") -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ValueError(f"{name} must be a list of integers")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} {bad[:8]} are outside the vocabulary [0, {vocab_size})")


def create_tokenized_object(
    obj: Union[GenerateReqInput, EmbeddingReqInput],
    input_text: Optional[str],
    input_ids: List[int],
    tokenizer: Any,
    vocab_size: int,
) -> Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput]:
    """Wrap ids + verified SamplingParams into what the scheduler consumes."""
    assert obj.is_single and isinstance(obj.rid, str)
    if len(input_ids) == 0:
        raise ValueError("The prompt is empty: send at least one token")
    if isinstance(obj, EmbeddingReqInput):
        # SGLang's embedding request: max_new_tokens 0, so the scheduler prefills it only and
        # reserves no output tokens for it (EmbeddingReqInput.normalize_batch_and_arguments)
        return TokenizedEmbeddingReqInput(
            rid=obj.rid, input_text=input_text, input_ids=list(input_ids),
            sampling_params=SamplingParams.from_dict(obj.sampling_params), dimensions=obj.dimensions,
            created_time=time.time(),
        )  # fmt: skip
    params = SamplingParams.from_dict(obj.sampling_params)
    params.normalize(tokenizer)
    params.verify(vocab_size)
    check_logprob_args(obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num, token_ids_logprob=obj.token_ids_logprob)
    if obj.token_ids_logprob:
        validate_input_ids(obj.token_ids_logprob, vocab_size, "token_ids_logprob")
    if obj.logprob_start_len > len(input_ids):  # (the scheduler checks again after any truncation)
        raise ValueError(
            f"logprob_start_len={obj.logprob_start_len} is higher than the number of input tokens "
            f"{len(input_ids)}. Request with a lower logprob_start_len."
        )
    return TokenizedGenerateReqInput(
        rid=obj.rid,
        input_text=input_text,
        input_ids=list(input_ids),
        sampling_params=params,
        return_logprob=bool(obj.return_logprob),
        logprob_start_len=obj.logprob_start_len,
        top_logprobs_num=obj.top_logprobs_num,
        token_ids_logprob=list(obj.token_ids_logprob) if obj.token_ids_logprob else None,
        return_hidden_states=bool(obj.return_hidden_states),
        lora_id=obj.lora_id,  # type: ignore[arg-type]  (a single request's one id, from resolve_lora_ids)
        extra_key=obj.extra_key or None,  # type: ignore[arg-type]  (checked by check_extra_key; "" is no key, as SGLang's)
        stream=obj.stream,
        priority=obj.priority,
        custom_logit_processor=obj.custom_logit_processor,
        require_reasoning=obj.require_reasoning,
        created_time=time.time(),
    )


def tokenize_one_request(
    tokenizer: Any, obj: Union[GenerateReqInput, EmbeddingReqInput], vocab_size: int
) -> Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput]:
    """Text or input_ids -> TokenizedGenerateReqInput, or TokenizedEmbeddingReqInput for an
    EmbeddingReqInput (synchronous; the Engine's path)."""
    if obj.input_ids is not None:
        input_ids = list(obj.input_ids)
        validate_input_ids(input_ids, vocab_size)
        input_text = None
    else:
        assert isinstance(obj.text, str)
        input_text = obj.text
        input_ids = encode_text(tokenizer, input_text, obj.add_special_tokens)
    return create_tokenized_object(obj, input_text, input_ids, tokenizer, vocab_size)


def check_dimensions(
    dimensions: Any, is_matryoshka: bool, matryoshka_dimensions: Optional[Sequence[int]], hidden_size: int, model: str
) -> None:
    """An embedding request's `dimensions` (SGLang's _validate_for_matryoshka_dim, its messages):
    only for a model trained for it (config.json's matryoshka_dimensions or is_matryoshka), one
    of the sizes it declares, at most the hidden size. Cutting any other model's embedding gives
    a vector that no longer means what the whole one did."""
    if dimensions is None:
        return
    if type(dimensions) is not int:
        raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
    if not is_matryoshka:
        raise ValueError(
            f"Model '{model}' does not support matryoshka representation, changing output dimensions will lead to "
            "poor results. Leave dimensions out (a model supports it when its config.json has matryoshka_dimensions "
            "or is_matryoshka)."
        )
    if dimensions < 1:
        raise ValueError("Requested dimensions must be greater than 0")
    if matryoshka_dimensions and dimensions not in matryoshka_dimensions:
        raise ValueError(
            f"Model '{model}' only supports {list(matryoshka_dimensions)} matryoshka dimensions, using other output "
            "dimensions will lead to poor results."
        )
    if dimensions > hidden_size:
        raise ValueError(f"Provided dimensions are greater than max embedding dimension: {hidden_size}")


def validate_context_length(
    tokenized: Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput],
    context_len: int,
    allow_auto_truncate: bool,
    max_req_input_len: Optional[int] = None,
) -> None:
    """Context-length gates with SGLang's messages; `allow_auto_truncate` truncates/clamps instead.

    `max_req_input_len` is the scheduler's own limit (prompts must stay below it: the
    context, or the KV pool, less 6 tokens; Scheduler.validate_input_length). Checking it
    here too makes a prompt between the two limits a 400 before any stream starts, and
    lets a truncated prompt keep room to generate.
    """
    limit = min(context_len, max_req_input_len or context_len)  # the longest prompt accepted is limit - 1
    input_len = len(tokenized.input_ids)
    params = tokenized.sampling_params
    prompt = "text" if tokenized.input_text is not None else "input_ids"  # (the field the errors are about)
    if input_len >= limit:
        # (SGLang's margin: an embedding request generates nothing, and the scheduler keeps it all the same)
        margin = "less a margin of a few tokens" if isinstance(tokenized, TokenizedEmbeddingReqInput) else "less room to generate"
        if not allow_auto_truncate:
            if input_len >= context_len:
                raise ParamError(f"The input ({input_len} tokens) is longer than the model's context length ({context_len} tokens).", prompt)
            raise ParamError(
                f"The input ({input_len} tokens) is longer than this server accepts ({limit - 1} tokens: the "
                f"context length of {context_len} tokens or the KV pool, {margin}). Use a shorter input "
                "or enable --allow-auto-truncate.",
                prompt,
            )
        # limit - 1: the longest prompt the scheduler's gate accepts as it is (its own
        # truncation, SGLang's, cuts to max_req_input_len and only sees prompts that skip this gate)
        tokenized.input_ids = tokenized.input_ids[: limit - 1]
        input_len = len(tokenized.input_ids)
    max_new = params.max_new_tokens
    if max_new is not None and input_len + max_new > context_len:
        if not allow_auto_truncate:
            raise ParamError(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {input_len + max_new} tokens: {input_len} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit.",
                # (OpenAI's param for it: the messages; but a budget that fills the context alone, beside
                # which no prompt fits, is the budget's fault: as OpenAI's "max_tokens is too large")
                "max_new_tokens" if max_new >= context_len else prompt,
            )
        params.max_new_tokens = max(0, context_len - input_len)
