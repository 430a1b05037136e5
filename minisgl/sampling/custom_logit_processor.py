"""Custom logit processors: client code that edits a request's logits before sampling (SGLang's).

Where it sits in the request chain:

    client: MyProcessor.to_str() -> the request's `custom_logit_processor` (a string), its
            parameters in `sampling_params["custom_params"]` (a JSON object)
    TokenizerManager / Engine: refuse it unless --enable-custom-logit-processor
            (tokenization.check_custom_logit_processor)
    Scheduler.handle_generate_request: `from_str` loads it once, on arrival (a string that
            does not load is the request's 400); the Req keeps the instance, and
            `Req.custom_params` = the request's custom_params + {"__req__": the Req}
    SamplingBatchInfo.from_reqs: the batch's rows grouped by processor string
    ModelRunner.sample: penalties, grammar mask, logit_bias, then each group's processor on its
            rows (`apply_custom_logit_processors`), then the Sampler (temperature, top-k, ...)

A processor is a subclass of `CustomLogitProcessor` whose `__call__(logits, custom_param_list)`
gets the logits of its rows, [n, V] float32 (a copy: the other rows are out of its reach), and
one params dict per row (the request's custom_params, with the scheduler's Req at "__req__":
`output_ids`, `origin_input_ids`, ... to read), and returns logits of the same shape, dtype and
device (it may edit them in place and return them). Each request gets its own instance when it
arrives, but a step runs the first request's instance on all the rows of its group, so state on
`self` is shared between requests and changes with the batch (SGLang makes a new instance every
step): keep a request's state in its params dict or on its Req (both live as long as it).

The string is SGLang's format, `{"callable": "<hex of dill.dumps(cls)>"}`: a class defined in
`__main__`, a notebook or a function travels by value (its code and the globals it names), one
in an importable module by reference (the server must be able to import it), so a client's
processor runs on a server that has never seen it.

SECURITY: `from_str` unpickles. Loading a processor runs whatever code the client put in the
string, with the server's rights. That is why the server refuses processors unless started with
--enable-custom-logit-processor (SGLang's flag, off by default): turn it on only where every
client may run code on the server.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from typing import Any, Dict, List, NamedTuple, Optional

import torch

# distinct processor strings whose loaded class is kept: a client sending new strings forever
# grows nothing past this (SGLang's cache is unbounded)
FROM_STR_CACHE_SIZE = 128


class CustomLogitProcessor(ABC):
    """A logits transform a request names; subclass it and implement __call__."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        """logits [n, V] float32 of the n rows using this processor; custom_param_list: one dict
        per row (its request's custom_params and "__req__"). Returns logits [n, V]."""
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        """The class as a JSON string for a request's `custom_logit_processor` (SGLang's format).

        recurse=True: a class defined by value takes the globals its methods name (torch, a
        helper) along, so it also runs where its module's other globals do not exist."""
        import dill

        return json.dumps({"callable": dill.dumps(cls, recurse=True).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> "CustomLogitProcessor":
        """An instance of the processor class `json_str` carries (the class is cached by string).

        ValueError (the request's 400) for a string that is not SGLang's format, does not
        unpickle, or holds something other than a CustomLogitProcessor subclass, and for a
        class whose constructor fails. Runs the client's code: see the module docstring."""
        if not isinstance(json_str, str):
            raise ValueError(f"custom_logit_processor must be a string (CustomLogitProcessor.to_str()), got {type(json_str).__name__}")
        processor_cls = _class_from_str(json_str)
        try:
            return processor_cls()
        except (Exception, SystemExit) as e:  # (the client's code: whatever it raises is its request's 400)
            raise ValueError(f"custom_logit_processor {processor_cls.__name__}() failed: {client_error_text(e)}") from None


@functools.lru_cache(maxsize=FROM_STR_CACHE_SIZE)
def _class_from_str(json_str: str) -> type:
    try:
        data = json.loads(json_str)
        payload = bytes.fromhex(data["callable"])
    except (ValueError, TypeError, KeyError, RecursionError):
        raise ValueError(
            'custom_logit_processor is not a serialized processor: expected the JSON text {"callable": "<hex>"} '
            "that CustomLogitProcessor.to_str() makes"
        ) from None
    import dill

    try:
        loaded = dill.loads(payload)
    except (Exception, SystemExit) as e:  # (the client's bytes: anything may go wrong, ModuleNotFoundError most often)
        raise ValueError(f"custom_logit_processor does not load here: {client_error_text(e)}") from None
    if not (isinstance(loaded, type) and issubclass(loaded, CustomLogitProcessor)):
        # (its type's name only: the object's own repr is the client's code, and may be any size)
        what = f"the class {loaded.__qualname__}" if isinstance(loaded, type) else f"a {type(loaded).__qualname__}"
        raise ValueError(
            f"custom_logit_processor must hold a subclass of minisgl's CustomLogitProcessor, got {what[:200]} "
            "(an SGLang processor subclasses SGLang's class: subclass minisgl.sampling.custom_logit_processor's)"
        )
    return loaded


def client_error_text(e: BaseException, limit: int = 500) -> str:
    """`Type: message` of the client's exception, cut to `limit` characters (it goes into a 400
    and a log line); its str() is the client's code too, so a failing one is named, not raised."""
    try:
        text = str(e)
    except Exception:
        text = "<its message could not be read>"
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + "..."


class LogitProcessorGroup(NamedTuple):
    """The rows of a batch that one processor string names (SamplingBatchInfo.custom_logit_processor)."""

    processor: CustomLogitProcessor
    rows: List[int]  # rows of the batch, ascending
    params: List[Dict[str, Any]]  # one per row: Req.custom_params (custom_params + "__req__")


def apply_custom_logit_processors(logits: torch.Tensor, groups: List[LogitProcessorGroup]) -> Dict[int, str]:
    """Run each group's processor on a copy of its rows of logits [bs, V] and write the result
    back, in place. Returns {row: error message} for the rows whose processor raised, returned
    something that is not a tensor of its rows' shape, dtype and device, or logits no token can
    be sampled from (NaN, +inf, or none finite where some were): their logits stay as they were,
    and the scheduler aborts those requests alone.

    A group that fails is run again one row at a time, so that one request's bad custom_params
    (a processor that checks them as it goes) cost that request only, not every request that
    names the same processor."""
    errors: Dict[int, str] = {}
    for group in groups:
        failed = _apply_rows(logits, group.processor, group.rows, group.params)
        if failed is None:
            continue
        if len(group.rows) == 1:
            errors[group.rows[0]] = failed
            continue
        for row, params in zip(group.rows, group.params):
            one = _apply_rows(logits, group.processor, [row], [params])
            if one is not None:
                errors[row] = one
    return errors


def _apply_rows(logits: torch.Tensor, processor: CustomLogitProcessor, rows: List[int], params: List[Dict[str, Any]]) -> Optional[str]:
    """`processor` on a copy of `rows`, written back when it gave usable logits for all of them;
    else the error message (and logits untouched)."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [n]
    before = logits.index_select(0, index)  # [n, V], a copy: a processor that fails half-way leaves logits intact
    name = type(processor).__name__
    try:
        out = processor(before.clone(), params)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"returned a {type(out).__name__}, not a tensor")
        if out.shape != before.shape or out.dtype != before.dtype or out.device != before.device:
            raise TypeError(
                f"returned a tensor of shape {tuple(out.shape)} {out.dtype} on {out.device}; "
                f"expected {tuple(before.shape)} {before.dtype} on {before.device}"
            )
    except (Exception, SystemExit) as e:  # the client's code: it must cost its own requests, never the server
        return f"custom logit processor {name} failed: {client_error_text(e)}"
    # logits no token can be sampled from: softmax of NaN or +inf is NaN, and so is that of a row
    # the processor left without any finite logit (one that had none before is not its doing)
    bad = torch.isnan(out).any(-1) | torch.isposinf(out).any(-1) | (~torch.isfinite(out).any(-1) & torch.isfinite(before).any(-1))
    if bool(bad.any()):
        return (
            f"custom logit processor {name} returned logits no token can be sampled from (NaN, +inf, or all -inf): "
            "to force a token, give it a finite logit (0) and the others -inf"
        )
    logits.index_copy_(0, index, out)
    return None


# --------------------------------------------------------------------------- built-in processors
class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """SGLang's example: the ids in custom_params["token_ids"] are never sampled (their logits -inf).

    Unlike SGLang's (which asserts every row names the same ids), each row bans its own list."""

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            ids = params.get("token_ids") if params else None
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError(f'custom_params must be {{"token_ids": [token ids]}}, got token_ids={ids!r}')
            bad = [t for t in ids if not 0 <= t < logits.shape[-1]]
            if bad:
                raise ValueError(f"token_ids {bad[:8]} are outside the vocabulary [0, {logits.shape[-1]})")
            logits[i, ids] = float("-inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """SGLang's thinking budget: custom_params {"thinking_budget": N}. Once N tokens follow the
    think-start token (prompt and output counted together, from its first occurrence) and no
    think-end token has come, the next token is forced: a newline, then the think-end token; the
    answer goes on after it (max_tokens still bounds the whole). A subclass names its model
    family's three token ids (Qwen3's, DeepSeek-R1's below).

    Unlike SGLang's (which skips a row whose budget is missing, not an int or negative), such a
    budget is the request's error: a budget the client sent is never silently dropped."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        ids = (self.THINKING_START_TOKEN_ID, self.THINKING_END_TOKEN_ID, self.NEW_LINE_TOKEN_ID)
        if max(ids) >= logits.shape[-1]:
            raise ValueError(f"{type(self).__name__}'s token ids {ids} are outside this model's vocabulary [0, {logits.shape[-1]}): "
                             "it is for another model family")  # fmt: skip
        for i, params in enumerate(custom_param_list or []):
            budget = params.get("thinking_budget") if params else None
            if type(budget) is not int or budget < 0:
                raise ValueError(f'custom_params must be {{"thinking_budget": a token count >= 0}}, got thinking_budget={budget!r}')
            req = params["__req__"]
            so_far = [*req.origin_input_ids, *req.output_ids]
            if self.THINKING_START_TOKEN_ID not in so_far or self.THINKING_END_TOKEN_ID in so_far:
                continue  # (not thinking: not begun, or over)
            if len(so_far) - so_far.index(self.THINKING_START_TOKEN_ID) - 1 < budget:
                continue
            # over budget: a newline first (how the model's own thinking ends), then the end token
            forced = self.THINKING_END_TOKEN_ID if req.output_ids and req.output_ids[-1] == self.NEW_LINE_TOKEN_ID else self.NEW_LINE_TOKEN_ID
            logits[i, :] = float("-inf")
            logits[i, forced] = 0.0
        return logits


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """The thinking budget for Qwen3's vocabulary (<think> 151667, </think> 151668, "\\n" 198)."""

    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """The thinking budget for DeepSeek-R1's vocabulary (<think> 128798, </think> 128799, "\\n" 201)."""

    THINKING_START_TOKEN_ID = 128798
    THINKING_END_TOKEN_ID = 128799
    NEW_LINE_TOKEN_ID = 201


# --reasoning-parser -> its family's budget processor (the Messages API's thinking.budget_tokens)
THINKING_BUDGET_PROCESSORS = {"qwen3": Qwen3ThinkingBudgetLogitProcessor, "deepseek-r1": DeepSeekR1ThinkingBudgetLogitProcessor}
