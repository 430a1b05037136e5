"""Typed messages between the stages of a request (seed 000 / seed 004).

    GenerateReqInput            HTTP layer -> TokenizerManager        (in-process only)
    TokenizedGenerateReqInput   TokenizerManager -> Scheduler         (ZMQ)
    BatchTokenIDOutput          Scheduler -> DetokenizerManager       (ZMQ)
    BatchStrOutput              DetokenizerManager -> TokenizerManager (ZMQ)
    EmbeddingReqInput -> TokenizedEmbeddingReqInput -> BatchEmbeddingOutput: the same chain for an
        embedding model (--is-embedding); the detokenizer passes the output through
    AbortReq, FlushCache*, GetLoad*, ProfileReq*, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput,
        LoRAUpdateOutput, UpdateWeightFromDisk*, UpdateWeightsFromTensor*, GetWeightsByName*,
        ClearDecodeStatusReq, FreezeGCReq, SchedulerSnapshotOut: control
    TpBroadcastInput            Scheduler rank 0 -> ranks 1..N-1     (--tp-size N: gloo broadcast, managers/tp_lockstep.py)

Everything that crosses a process boundary is one of the dataclasses registered in
`_MESSAGE_TYPES` and travels as JSON through `encode` / `decode`: no pickling of
arbitrary objects, no lookups in `globals()` (STYLE.md habit 4). Each type has a
round-trip test (tests/test_io_struct.py). The exceptions to "all JSON" are hidden states
(`HiddenStateRows`): their float32 rows ride as raw bytes after the JSON, in the same frame; and
`bytes` fields (a weight update's safetensors files), which ride there too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from minisgl.sampling.sampling_params import GRAMMAR_KEYS, SamplingParams
from minisgl.utils import lone_surrogate_at


# The server's caps on one GenerateReqInput (the TokenizerManager's checks; /v1/score's mixin
# applies them to a score call's items and labels before building one). The in-process Engine,
# one user's, has none.
MAX_SUB_REQUESTS = 4096  # prompts x n
MAX_TOKEN_IDS_LOGPROB = 256  # ids of token_ids_logprob (class labels are a handful; each is reported at every position)


def new_rid() -> str:
    return uuid.uuid4().hex


def batch_rids(rid: Any, n: int) -> List[str]:
    """A batch of n prompts' rids: the caller's list of n, or n new ones."""
    if rid is None:
        return [new_rid() for _ in range(n)]
    if not isinstance(rid, list) or len(rid) != n:
        raise ValueError(f"`rid` must be a list of {n} ids for a batch of {n} prompts")
    return rid


# --------------------------------------------------------------------------- requests
def check_same_n(param_dicts: List[Any]) -> None:
    """SGLang's rule for a batch: every prompt asks for the same number of samples, so that
    result i*n + j is sample j of prompt i."""
    # (only well-typed n compared: this runs before the types are checked, and a list n was a
    # TypeError, a 500; SamplingParams.from_dict refuses it with a message after this)
    ns = {n for n in (d.get("n", 1) if isinstance(d, dict) else 1 for d in param_dicts) if type(n) is int}
    if len(ns) > 1:
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")


def check_logprob_args(
    return_logprob: Union[bool, List[bool]], logprob_start_len: Any, top_logprobs_num: Any,
    return_text_in_logprobs: bool = False, token_ids_logprob: Any = None,
) -> None:  # fmt: skip
    """The logprob fields of a request (the server's and the Engine's): each needs
    return_logprob, none is ignored."""
    if type(logprob_start_len) is not int or logprob_start_len < -1:
        raise ValueError(
            "logprob_start_len must be -1 (output logprobs only) or the prompt position where prompt "
            f"logprobs start (0 for all of them), got {logprob_start_len!r}"
        )
    if type(top_logprobs_num) is not int or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
    if token_ids_logprob is not None and (
        not isinstance(token_ids_logprob, list) or not all(type(t) is int for t in token_ids_logprob)
    ):
        raise ValueError(f"token_ids_logprob must be a list of token ids, got {token_ids_logprob!r}")
    if all(return_logprob) if isinstance(return_logprob, list) else return_logprob:
        return
    if top_logprobs_num:
        raise ValueError("top_logprobs_num needs return_logprob to be true")
    if logprob_start_len != -1:
        raise ValueError("logprob_start_len needs return_logprob to be true")
    if return_text_in_logprobs:
        raise ValueError("return_text_in_logprobs needs return_logprob to be true")
    if token_ids_logprob:
        raise ValueError("token_ids_logprob needs return_logprob to be true")


def check_rids(is_single: bool, rid: Any, max_chars: Optional[int] = None) -> None:
    """The rid rules of the server and the Engine, on a normalized input: a string per prompt
    (a single prompt: one string), none empty (the scheduler reads "" as no rid: it could never
    be aborted), no repeat within a batch, valid Unicode (each is echoed in every answer), and
    at most `max_chars` each (the server's bound: a rid rides in every step's messages)."""
    if is_single and not isinstance(rid, str):
        raise ValueError(f"`rid` must be a string for a single prompt, got {type(rid).__name__}")
    rids = [rid] if is_single else rid
    for one in rids:
        if not isinstance(one, str):
            raise ValueError(f"`rid` of a batch must be a list of strings, got a {type(one).__name__} in it")
        if one == "":
            raise ValueError("`rid` must not be empty; leave it out for a generated one")
        if max_chars is not None and len(one) > max_chars:
            raise ValueError(f"`rid` takes at most {max_chars} characters, got {len(one)}")
        if lone_surrogate_at(one) is not None:
            raise ValueError(f"`rid` must be valid Unicode, got {one!r} (a lone surrogate)")
    if len(set(rids)) != len(rids):
        raise ValueError("`rid` must not repeat an id within a batch")


def prompt_shape(text: Any, input_ids: Any) -> Tuple[bool, int]:
    """(is_single, batch_size) of a request's prompt: a string or a list of them, or a list of
    ids or a list of such lists (exactly one of the two given)."""
    if (text is None) == (input_ids is None):
        raise ValueError("Exactly one of `text` and `input_ids` must be given")
    if text is not None:
        is_single = isinstance(text, str)
        batch_size = 1 if is_single else len(text)
    else:
        is_single = len(input_ids) == 0 or not isinstance(input_ids[0], list)
        batch_size = 1 if is_single else len(input_ids)
    if not is_single and batch_size == 0:
        raise ValueError("A batch request needs at least one prompt")
    return is_single, batch_size


@dataclass
class GenerateReqInput:
    """The unified runtime request: it no longer knows whether it came from chat or completions."""

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    # the logprob fields: one value for every prompt of a batch, or a list of one per prompt
    return_logprob: Union[bool, List[bool]] = False
    logprob_start_len: Union[int, List[int]] = -1  # prompt logprobs from this position (-1: none)
    top_logprobs_num: Union[int, List[int]] = 0
    token_ids_logprob: Optional[Union[List[int], List[Optional[List[int]]]]] = None  # ids every position reports
    return_text_in_logprobs: bool = False  # each logprob entry's third element: the token's text
    # SGLang's: the final-norm hidden states of the tokens the model computes for the request, in
    # meta_info["hidden_states"] (needs --enable-return-hidden-states); one for all prompts or one per prompt
    return_hidden_states: Union[bool, List[bool]] = False
    # SGLang's: the name of the loaded LoRA adapter (--lora-paths, /load_lora_adapter) to run the
    # request with, None for the base model; one for all prompts of a batch or a list of one per prompt
    lora_path: Optional[Union[str, List[Optional[str]]]] = None
    # SGLang's: the id of that adapter's load (lora/lora_registry.py), filled from lora_path by the
    # TokenizerManager and the Engine (tokenization.resolve_lora_ids), never by a client
    lora_id: Optional[Union[str, List[Optional[str]]]] = None
    # SGLang's: the request's own radix-tree namespace (a tenant's cache salt; the OpenAI routes'
    # cache_salt + extra_key): prompts under two keys never share cached K/V. One string for all
    # prompts of a batch or a list of one per prompt; None or "" is no key (docs/server.md)
    extra_key: Optional[Union[str, List[Optional[str]]]] = None
    stream: bool = False
    priority: Optional[int] = None
    # SGLang's: CustomLogitProcessor.to_str() (needs --enable-custom-logit-processor), one for every
    # prompt of a batch or a list of one per prompt (None: none); its parameters are each prompt's
    # sampling_params["custom_params"]
    custom_logit_processor: Optional[Union[str, List[Optional[str]]]] = None
    # SGLang's: the model thinks first (a chat with --reasoning-parser): its grammar, if any,
    # holds only from the end of the thinking on
    require_reasoning: bool = False
    log_metrics: bool = True  # False for /health_generate's probe (SGLang's field)
    # the tokenizer's special tokens (a BOS) around a text prompt, as SGLang's and vLLM's
    # completions; False for a rendered chat template, which writes its own
    add_special_tokens: bool = True
    # filled by normalize_batch_and_arguments()
    is_single: bool = True
    batch_size: int = 1

    def normalize_batch_and_arguments(self) -> None:
        """Decide single vs batch and broadcast per-request arguments to lists for a batch."""
        # None is SGLang's default for these (its Engine.generate passes it on): the default here
        for name, default in (
            ("return_logprob", False), ("logprob_start_len", -1), ("top_logprobs_num", 0), ("return_hidden_states", False),
        ):  # fmt: skip
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.is_single, self.batch_size = prompt_shape(self.text, self.input_ids)
        if self.is_single:
            if self.rid is None:
                self.rid = new_rid()
            if isinstance(self.sampling_params, list) or any(isinstance(v, list) for v in self._one_per_prompt_fields()):
                raise ValueError("A single prompt takes one `sampling_params` dict and one value of `return_logprob`, "
                                 "`logprob_start_len`, `top_logprobs_num`, `custom_logit_processor`, "
                                 "`return_hidden_states`, `lora_path`, `extra_key` (and one `token_ids_logprob` list); lists are per prompt of "
                                 "a batch")  # fmt: skip
            return
        n = self.batch_size
        self.rid = batch_rids(self.rid, n)
        if not isinstance(self.sampling_params, list):
            self.sampling_params = [dict(self.sampling_params or {}) for _ in range(n)]
        elif len(self.sampling_params) != n:
            raise ValueError(f"`sampling_params` must have {n} entries for a batch of {n} prompts")
        check_same_n(self.sampling_params)
        for name in (
            "return_logprob", "logprob_start_len", "top_logprobs_num", "custom_logit_processor", "return_hidden_states",
            "lora_path", "lora_id", "extra_key",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, list):
                setattr(self, name, [value] * n)
            elif len(value) != n:
                raise ValueError(f"`{name}` must have {n} entries for a batch of {n} prompts")
        if self._token_ids_per_prompt():
            if len(self.token_ids_logprob) != n:  # type: ignore[arg-type]
                raise ValueError(f"`token_ids_logprob` must have {n} lists for a batch of {n} prompts")
        else:
            self.token_ids_logprob = [self.token_ids_logprob] * n  # type: ignore[list-item]

    def check_rids(self, max_chars: Optional[int] = None) -> None:
        """The rid rules of the server and the Engine (check_rids below)."""
        check_rids(self.is_single, self.rid, max_chars)

    def _token_ids_per_prompt(self) -> bool:
        """token_ids_logprob as one list per prompt ([[ids], [ids]]), not one list for all."""
        ids = self.token_ids_logprob
        return isinstance(ids, list) and len(ids) > 0 and all(x is None or isinstance(x, list) for x in ids)

    def _one_per_prompt_fields(self) -> List[Any]:
        """The fields a batch may give as one list per prompt (a single prompt: a list of them is
        an error); token_ids_logprob only when it is a list of lists."""
        per_prompt_ids = [self.token_ids_logprob] if self._token_ids_per_prompt() else []
        return [
            self.return_logprob, self.logprob_start_len, self.top_logprobs_num, self.custom_logit_processor,
            self.return_hidden_states, self.lora_path, self.extra_key, *per_prompt_ids,
        ]  # fmt: skip

    def __getitem__(self, i: int) -> "GenerateReqInput":
        """The i-th request of a normalized batch, as a single request."""
        assert not self.is_single
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],  # type: ignore[index]
            logprob_start_len=self.logprob_start_len[i],  # type: ignore[index]
            top_logprobs_num=self.top_logprobs_num[i],  # type: ignore[index]
            token_ids_logprob=self.token_ids_logprob[i],  # type: ignore[index]
            return_text_in_logprobs=self.return_text_in_logprobs,
            return_hidden_states=self.return_hidden_states[i],  # type: ignore[index]
            lora_path=self.lora_path[i],  # type: ignore[index]
            lora_id=self.lora_id[i],  # type: ignore[index]
            extra_key=self.extra_key[i],  # type: ignore[index]
            stream=self.stream,
            priority=self.priority,
            custom_logit_processor=self.custom_logit_processor[i],  # type: ignore[index]
            require_reasoning=self.require_reasoning,
            log_metrics=self.log_metrics,
            add_special_tokens=self.add_special_tokens,
        )

    def singles(self) -> List["GenerateReqInput"]:
        """One single request per prompt of a normalized input (itself when single)."""
        return [self] if self.is_single else [self[i] for i in range(self.batch_size)]


class Sample(NamedTuple):
    """One sub-request of `expand_samples`: what the scheduler gets, and where it came from."""

    req: GenerateReqInput  # a single request with n = 1
    prompt_index: int  # the prompt of the client's batch it samples
    parent_rid: str  # the rid the client gave that prompt (req.rid is `<parent_rid>-<j>` when n > 1)


def expand_samples(obj: GenerateReqInput) -> List[Sample]:
    """A normalized request fanned out into single n = 1 requests, one per (prompt i, sample
    j) at index i * n + j: SGLang sends n copies of a prompt to the scheduler.

    Samples of one prompt get rids `<rid>-<j>` (aborting `<rid>` aborts them all) and seed + j,
    so that a seeded n > 1 request returns n different yet reproducible samples. The server's
    TokenizerManager and the in-process Engine both fan out here, so their answers agree.
    """
    out: List[Sample] = []
    for i, single in enumerate(obj.singles()):
        params = dict(single.sampling_params or {})
        n = int(params.get("n", 1))
        for j in range(n):
            sub_params = dict(params, n=1)
            if n > 1 and params.get("seed") is not None:
                sub_params["seed"] = int(params["seed"]) + j
            sub = dataclasses.replace(single, sampling_params=sub_params, is_single=True, batch_size=1)
            sub.rid = f"{single.rid}-{j}" if n > 1 else single.rid
            out.append(Sample(sub, i, single.rid))
    return out


@dataclass
class TokenizedGenerateReqInput:
    """What the scheduler consumes: ids, verified SamplingParams, control fields."""

    rid: str
    input_text: Optional[str]
    input_ids: List[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    return_hidden_states: bool = False  # (checked against --enable-return-hidden-states before it is built)
    lora_id: Optional[str] = None  # the id of the adapter's load (SGLang's field; lora_registry.py), None: the base model
    extra_key: Optional[str] = None  # the request's own cache namespace (None: none); Req.extra_key adds lora_id
    stream: bool = False
    priority: Optional[int] = None
    custom_logit_processor: Optional[str] = None  # CustomLogitProcessor.to_str(): loaded by the scheduler
    require_reasoning: bool = False
    created_time: float = 0.0  # time.time() when tokenization finished (nothing reads it yet)


def prefix_warmups(samples: List["Sample"], tokenized: List[TokenizedGenerateReqInput]) -> List[TokenizedGenerateReqInput]:
    """SGLang's "cache the common prefix for parallel sampling": for each prompt asked for n > 1
    samples, a request with max_new_tokens 0 (no logprobs, its own rid) that prefills the prompt
    alone and leaves it in the radix tree, sent and awaited before the samples. Without it, the
    copies that land in one prefill batch each computed the whole prompt."""
    warmups, warmed = [], set()
    for sample, tok in zip(samples, tokenized):
        if sample.req.rid != sample.parent_rid and sample.prompt_index not in warmed:  # (n > 1: its first sample)
            warmed.add(sample.prompt_index)
            params = tok.sampling_params.copy()
            params.max_new_tokens, params.min_new_tokens = 0, 0
            params.custom_params = None  # (nor a processor to run)
            for key in GRAMMAR_KEYS:  # (it samples nothing: no grammar to compile)
                setattr(params, key, None)
            warmups.append(TokenizedGenerateReqInput(
                rid=f"{sample.parent_rid}-prefix-{new_rid()}", input_text=tok.input_text, input_ids=tok.input_ids,
                sampling_params=params, priority=tok.priority, created_time=tok.created_time,
                # (the samples find the prompt under their own namespace: adapter and key)
                lora_id=tok.lora_id, extra_key=tok.extra_key,
            ))  # fmt: skip
    return warmups


@dataclass
class EmbeddingReqInput:
    """An embedding request (a server started with --is-embedding; SGLang's): text or input_ids,
    one prompt or a batch. It only prefills: its answer is {"embedding": [float], "meta_info"}."""

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    # Matryoshka: the embedding's first `dimensions` numbers, normalised again (one value for a whole
    # batch, as OpenAI's); only for a model whose config.json declares it (tokenization.check_dimensions)
    dimensions: Optional[int] = None
    log_metrics: bool = True  # False for /health_generate's probe
    add_special_tokens: bool = True  # the tokenizer's own special tokens around a text prompt, as SGLang's
    # filled by normalize_batch_and_arguments(): SGLang's {"max_new_tokens": 0} per prompt, which makes
    # the scheduler's request prefill-only and reserve no output tokens
    sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None
    is_single: bool = True
    batch_size: int = 1
    # what the TokenizerManager reads of every request: an embedding never streams, has no logprobs
    stream: ClassVar[bool] = False
    return_text_in_logprobs: ClassVar[bool] = False

    def normalize_batch_and_arguments(self) -> None:
        self.is_single, self.batch_size = prompt_shape(self.text, self.input_ids)
        if self.is_single:
            self.rid = new_rid() if self.rid is None else self.rid
            self.sampling_params = {"max_new_tokens": 0}
            return
        n = self.batch_size
        self.rid = batch_rids(self.rid, n)
        self.sampling_params = [{"max_new_tokens": 0} for _ in range(n)]

    def check_rids(self, max_chars: Optional[int] = None) -> None:
        check_rids(self.is_single, self.rid, max_chars)

    def __getitem__(self, i: int) -> "EmbeddingReqInput":
        """The i-th request of a normalized batch, as a single request."""
        assert not self.is_single
        return EmbeddingReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            rid=self.rid[i],  # type: ignore[index]
            dimensions=self.dimensions,
            log_metrics=self.log_metrics,
            add_special_tokens=self.add_special_tokens,
            sampling_params=self.sampling_params[i],  # type: ignore[index]
        )

    def singles(self) -> List["EmbeddingReqInput"]:
        """One single request per prompt of a normalized input (itself when single)."""
        return [self] if self.is_single else [self[i] for i in range(self.batch_size)]


@dataclass
class TokenizedEmbeddingReqInput:
    """What the scheduler consumes for an embedding: ids and a prefill-only SamplingParams
    (max_new_tokens 0, SGLang's), and the Matryoshka cut the Pooler applies."""

    rid: str
    input_text: Optional[str]
    input_ids: List[int]
    sampling_params: SamplingParams
    dimensions: Optional[int] = None
    created_time: float = 0.0  # time.time() when tokenization finished (nothing reads it yet)


@dataclass
class AbortReq:
    """Abort one rid (or all), TokenizerManager -> Scheduler. The scheduler answers through
    the normal output path: the request finishes with finish_reason {"type": "abort", ...}."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class FlushCacheReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetLoadReqInput:
    pass


@dataclass
class GetLoadReqOutput:
    """Scheduler load and KV accounting, for /metrics and tests (KV returns to zero when idle)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    available_tokens: int
    evictable_tokens: int
    protected_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float
    new_token_ratio: float
    num_retracted_reqs_total: int = 0
    gen_throughput: float = 0.0  # output tokens/s at the last decode log line (0 when idle)


class ProfileReqType:
    """What a ProfileReq asks for. SGLang's is an Enum; plain strings here keep the message
    plain JSON."""

    START_PROFILE = "START_PROFILE"
    STOP_PROFILE = "STOP_PROFILE"


@dataclass
class ProfileReq:
    """Start or stop torch.profiler in the scheduler (SGLang's ProfileReq): TokenizerManager ->
    Scheduler for /start_profile and /stop_profile, a direct call for Engine.start_profile.

    None asks for the default, which the scheduler fills in (scheduler_profiler_mixin.py):
    output_dir $SGLANG_TORCH_PROFILER_DIR or /tmp, activities CPU (+ GPU on CUDA), with_stack and
    record_shapes true. A stop request uses `type` alone."""

    type: str  # ProfileReqType.START_PROFILE or STOP_PROFILE
    output_dir: Optional[str] = None
    num_steps: Optional[int] = None  # stop by itself after this many steps that ran a batch
    activities: Optional[List[str]] = None  # "CPU", "GPU", "MEM"
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    profile_prefix: Optional[str] = None  # the trace file's name starts with "<profile_prefix>-"


@dataclass
class ProfileReqOutput:
    """The scheduler's answer to a ProfileReq. `success` false: `message` says why (the route's
    400). `paths`: the files a stop wrote (the Chrome trace, and MEM's snapshot)."""

    success: bool
    message: str = ""
    paths: List[str] = field(default_factory=list)


@dataclass
class LoadLoRAAdapterReqInput:
    """Load a PEFT adapter while serving (SGLang's /load_lora_adapter, Engine.load_lora_adapter):
    TokenizerManager -> Scheduler, whose LoRAManager reads and checks it. `lora_id` is minted by
    the TokenizerManager's LoRARegistry (a new one per load), which registers the name only
    once the scheduler answered success."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # (every minisgl adapter stays resident: docs/model_execution.md)
    lora_id: Optional[str] = None


@dataclass
class UnloadLoRAAdapterReqInput:
    """Drop a loaded adapter's weights (SGLang's /unload_lora_adapter): sent by the TokenizerManager
    after it unregistered the name and its last request finished. The scheduler answers it once
    none of its own requests uses the load either (Scheduler.pending_lora_unloads)."""

    lora_name: str
    lora_id: Optional[str] = None


@dataclass
class LoRAUpdateOutput:
    """The scheduler's answer to a load or an unload (SGLang's LoRAUpdateOutput, which it also names
    LoadLoRAAdapterReqOutput and UnloadLoRAAdapterReqOutput). `error_message` says why when
    `success` is false; `loaded_adapters`: name -> directory of every adapter loaded after it."""

    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Dict[str, str] = field(default_factory=dict)


LoadLoRAAdapterReqOutput = UnloadLoRAAdapterReqOutput = LoRAUpdateOutput  # (SGLang's aliases: one type)


@dataclass
class UpdateWeightFromDiskReqInput:
    """Load new weights of the served model from a checkpoint directory (SGLang's
    /update_weights_from_disk, Engine.update_weights_from_disk): TokenizerManager -> Scheduler
    (every rank), once no request of the old weights is in flight (docs/model_execution.md)."""

    model_path: str
    load_format: Optional[str] = None  # None, "auto" or "safetensors" (what minisgl reads)
    abort_all_requests: bool = False  # abort the requests in flight instead of letting them finish first
    weight_version: Optional[str] = None  # the new weights' name, reported from then on (the TokenizerManager's)


@dataclass
class UpdateWeightFromDiskReqOutput:
    """The scheduler's answer (SGLang's): `message` says why when `success` is false, and the old
    weights are still served then. num_paused_requests: SGLang's field; always 0 here (nothing pauses)."""

    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass
class UpdateWeightsFromTensorReqInput:
    """Load (name, tensor) pairs into the served model (SGLang's Engine.update_weights_from_tensor and
    /update_weights_from_tensor). `serialized_named_tensors`: safetensors files, raw bytes (after the
    frame's JSON; the HTTP route decoded the body's base64), never SGLang's pickles. `named_tensors`:
    the Engine's own (name, tensor) pairs when its scheduler is in its process (tp_size 1): never
    copied, never encoded (encode refuses a tensor). `flush_cache` false keeps the radix cache's K/V
    of the previous weights (one bucket of several: flush with the last)."""

    serialized_named_tensors: List[bytes]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    named_tensors: Optional[List[Tuple[str, Any]]] = None


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str


@dataclass
class GetWeightsByNameReqInput:
    """The first `truncate_size` rows of a parameter, by its checkpoint name (SGLang's /get_weights_by_name)."""

    name: str
    truncate_size: int = 100


@dataclass
class GetWeightsByNameReqOutput:
    """`parameter`: the values (None when `message` says why not: SGLang answers None alone)."""

    parameter: Optional[List[Any]]
    message: str = ""


@dataclass
class FreezeGCReq:
    """Freeze the garbage collector (SGLang's /freeze_gc): TokenizerManager -> Scheduler ->
    Detokenizer, each process calling `utils.freeze_gc`. After start-up almost every object
    (the model, the tokenizer, the pools) lives forever; frozen, the GC stops scanning them,
    so its pauses no longer grow with them."""


@dataclass
class ClearDecodeStatusReq:
    """Tell the detokenizer to drop the decode state of these rids. Kept for SGLang parity:
    nothing in minisgl sends it, since aborted requests end through the normal finish path."""

    rids: List[str] = field(default_factory=list)


@dataclass
class SchedulerSnapshotOut:
    """One scheduler step's snapshot (schema: docs/snapshot.md), published with --visualize."""

    step: int
    snapshot_json: str


@dataclass
class TpBroadcastInput:
    """One scheduler iteration's inputs, rank 0 -> the other tensor-parallel ranks (--tp-size N).

    SGLang's rank 0 broadcasts the list it read from the TokenizerManager's socket
    (`broadcast_pyobj(recv_reqs)` in recv_requests); here the list travels inside this
    message, encoded like every other one. Each rank then runs the same
    process_input_requests(recv_reqs) and, when `run_step`, the same run_step(), so all
    schedulers make the same decisions (managers/tp_lockstep.py)."""

    recv_reqs: List[Any]  # registered messages, in the order rank 0 processes them
    run_step: bool = True  # the server's loop always steps; the Engine hands over requests without a step too
    shutdown: bool = False  # the Engine is closing: the other ranks leave their loop
    # rank 0's scheduler before these inputs (tp_lockstep.lockstep_state): each rank checks its own
    # against it, so ranks that fell out of step stop with an error instead of exchanging wrong tensors
    lockstep_state: List[int] = field(default_factory=list)


# --------------------------------------------------------------------------- outputs
@dataclass(eq=False)
class HiddenStateRows:
    """One request's new hidden-state entries in one output message (return_hidden_states), as
    float32 rows: `rows[:prompt_rows]` is entry 0, the prompt's [n, H] rows (with the request's
    first output only; prompt_rows 0 after it), and every later row is an entry of its own, one
    decode step's [H]. `entries()` gives Req.hidden_states' layout back.

    They cross the processes as raw bytes after the message's JSON (`encode`), not as JSON numbers:
    a 2,000 x 1,024 prompt entry took 1.6 s to encode as numbers, and 0.5 ms as bytes."""

    rows: np.ndarray  # [prompt_rows + decode entries, H] float32 (read-only once decoded: a view of the frame)
    prompt_rows: int = 0

    @staticmethod
    def empty() -> "HiddenStateRows":
        """A request that asked, with nothing new in this message."""
        return HiddenStateRows(np.empty((0, 0), dtype=np.float32))

    def entries(self) -> List[np.ndarray]:
        """Req.hidden_states' layout: entry 0 an [n, H] array (when this message has the prompt's
        rows), then one [H] array per decode step. Views of `rows`, no copy."""
        p = self.prompt_rows
        return ([self.rows[:p]] if p else []) + list(self.rows[p:])

    def as_lists(self) -> List[Any]:
        """entries() as Python lists, the values the JSON answer writes (the Engine's result)."""
        return [entry_as_list(entry) for entry in self.entries()]

    def __eq__(self, other: object) -> bool:  # bit for bit (NaNs and -0.0 too): what the wire must keep
        if not isinstance(other, HiddenStateRows):
            return NotImplemented
        return (self.prompt_rows == other.prompt_rows and self.rows.shape == other.rows.shape
                and self.rows.dtype == other.rows.dtype and self.rows.tobytes() == other.rows.tobytes())  # fmt: skip


def entry_as_list(entry: np.ndarray) -> List[Any]:
    """A hidden-state entry ([H] or [n, H] float32) as Python floats, NaN and inf as None: JSON has
    neither, and SGLang's orjson writes null, so a valid request is never a serialization error.
    (float32 -> double is exact: the JSON text is the shortest repr that reads back as the float32.)"""
    values = entry.tolist()
    if bool(np.isfinite(entry).all()):
        return values
    if entry.ndim == 1:
        return [v if math.isfinite(v) else None for v in values]
    return [[v if math.isfinite(v) else None for v in row] for row in values]


@dataclass(kw_only=True)
class LogprobLists:
    """The logprob fields of an output message, one entry per request, as SGLang's (_val and
    _idx lists side by side). Empty lists, not lists of empties, when no request of the message
    asked. BatchTokenIDOutput and BatchStrOutput both carry them; the detokenizer passes them
    through (`logprob_lists`), `logprobs_of` reads them."""

    # logprobs of the new tokens
    output_token_logprobs_val: List[List[float]] = field(default_factory=list)
    output_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    # prompt logprobs, once per request (Req.finish_input_logprobs's layout)
    input_token_logprobs_val: List[List[Optional[float]]] = field(default_factory=list)
    input_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    input_top_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_top_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)
    # logprobs of the ids a request names (token_ids_logprob): per output token, per prompt position
    output_token_ids_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_token_ids_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    input_token_ids_logprobs_val: List[List[Optional[List[float]]]] = field(default_factory=list)
    input_token_ids_logprobs_idx: List[List[Optional[List[int]]]] = field(default_factory=list)

    def logprob_lists(self) -> Dict[str, List[Any]]:
        """These fields, by name (shallow copies), to build another message with."""
        return {f.name: list(getattr(self, f.name)) for f in dataclasses.fields(LogprobLists)}


@dataclass
class BatchTokenIDOutput(LogprobLists):
    """Scheduler -> detokenizer: new token ids of every request that emits this step.

    `decode_ids[i]` is the delta of ids to append to the detokenizer's window; on the
    first emission of a rid it starts with up to 5 prompt tokens of left context and
    `read_offsets[i]` marks where the output begins inside that window.
    `output_ids[i]` is the delta of output ids (through the stop token, if any).
    """

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    decode_ids: List[List[int]]
    read_offsets: List[int]
    output_ids: List[List[int]]
    skip_special_tokens: List[bool]
    spaces_between_special_tokens: List[bool]
    no_stop_trim: List[bool]
    stop_strs: List[List[str]]
    stop_regexes: List[List[str]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    # per-request timing in milliseconds (ReqTimeStats.to_ms_dict): queue_ms / schedule_ms / forward_ms / ttft_ms / e2e_ms
    time_stats: List[Dict[str, Optional[float]]] = field(default_factory=list)  # None = not reached
    # return_hidden_states: per request, the entries of its Req.hidden_states not sent before, as float32
    # rows (None: it did not ask); an empty list, not a list of Nones, when no request of the message asked
    output_hidden_states: List[Optional[HiddenStateRows]] = field(default_factory=list)
    # --speculative-algorithm: per request, its decoding passes so far (SGLang's spec_verify_ct); an
    # empty list when the server does not speculate
    spec_verify_ct: List[int] = field(default_factory=list)


@dataclass
class BatchStrOutput(LogprobLists):
    """Detokenizer -> TokenizerManager: text deltas, ready for the client."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_strs: List[str]
    output_ids: List[List[int]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    time_stats: List[Dict[str, Optional[float]]] = field(default_factory=list)  # to_ms_dict: None = not reached
    output_hidden_states: List[Optional[HiddenStateRows]] = field(default_factory=list)  # BatchTokenIDOutput's, passed through
    spec_verify_ct: List[int] = field(default_factory=list)  # BatchTokenIDOutput's, passed through


@dataclass
class BatchEmbeddingOutput:
    """Scheduler -> DetokenizerManager (passed through) -> TokenizerManager: the embedding
    requests that finished this step (an embedding is sent once, whole)."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    embeddings: List[Optional[List[float]]]  # None: it ended without one (aborted before its last chunk ran)
    prompt_tokens: List[int]
    cached_tokens: List[int]
    time_stats: List[Dict[str, Optional[float]]] = field(default_factory=list)  # to_ms_dict: None = not reached


# the meta_info keys of a response dict that hold per-token lists: a streamed dict carries the
# new entries only (prompt logprobs come once), a non-streaming answer all of them
LOGPROB_META_KEYS = (
    "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
    "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
)  # fmt: skip

# SGLang's entry: (logprob, token id, token text); the text is None unless return_text_in_logprobs,
# the logprob None for the prompt's first token (nothing scores it)
LogprobEntry = Tuple[Optional[float], int, Optional[str]]


def logprobs_of(recv: BatchStrOutput, i: int, decode: Optional[Callable[[List[List[int]]], List[str]]] = None) -> Dict[str, List[Any]]:
    """Request i's logprobs in this message, by meta_info key (LOGPROB_META_KEYS): lists of
    LogprobEntry, and of top-k lists of them (None where no token is scored: the prompt's
    first). Empty when not requested. `decode` (a tokenizer's batch_decode) fills the texts.

    Here, next to the message, so the Engine reads outputs as the TokenizerManager does
    without importing it (and pyzmq with it)."""

    def row(name: str) -> List[Any]:
        rows = getattr(recv, name)
        return rows[i] if i < len(rows) else []

    # the common case, a request that asked for none, on every output of every request: no zips
    if not row("output_token_logprobs_val") and not row("input_token_logprobs_idx"):
        return {key: [] for key in LOGPROB_META_KEYS}

    def entries(values: List[Any], ids: List[int]) -> List[LogprobEntry]:
        texts: List[Any] = decode([[t] for t in ids]) if decode is not None and ids else [None] * len(ids)
        # (strict: values and ids are built apart, e.g. the prompt's chunk by chunk and from the prompt)
        return list(zip(values, ids, texts, strict=True))

    def per_position(name: str) -> List[Optional[List[LogprobEntry]]]:  # top-k lists, or the named ids'
        pairs = zip(row(f"{name}_val"), row(f"{name}_idx"), strict=True)
        return [None if values is None else entries(values, ids) for values, ids in pairs]

    return {
        "output_token_logprobs": entries(row("output_token_logprobs_val"), row("output_token_logprobs_idx")),
        "output_top_logprobs": per_position("output_top_logprobs"),
        "output_token_ids_logprobs": per_position("output_token_ids_logprobs"),
        "input_token_logprobs": entries(row("input_token_logprobs_val"), row("input_token_logprobs_idx")),
        "input_top_logprobs": per_position("input_top_logprobs"),
        "input_token_ids_logprobs": per_position("input_token_ids_logprobs"),
    }


def hidden_states_of(recv: Union[BatchTokenIDOutput, BatchStrOutput], i: int) -> Optional[HiddenStateRows]:
    """Request i's new hidden-state rows in this message (`.entries()`: Req.hidden_states' layout,
    the prompt's [n, H] rows first, then one [H] row per output token), or None when it did not ask."""
    rows = recv.output_hidden_states
    return rows[i] if i < len(rows) else None


def spec_meta_info(recv: Union[BatchTokenIDOutput, BatchStrOutput], i: int) -> Dict[str, Any]:
    """meta_info's speculative-decoding keys for request i ({} when the server does not speculate),
    SGLang's: spec_verify_ct (its decoding passes, each a verify or a plain decode step) and
    spec_accept_length (completion tokens per pass; the first token, the prefill's, counts too,
    as in SGLang; None before the first pass)."""
    if i >= len(recv.spec_verify_ct):
        return {}
    passes = recv.spec_verify_ct[i]
    # (no decoding pass yet, or none at all: a request that ended with its prefill has no ratio, as the snapshot's null)
    return {"spec_verify_ct": passes, "spec_accept_length": recv.completion_tokens[i] / passes if passes else None}


# --------------------------------------------------------------------------- codec
_MESSAGE_TYPES: Dict[str, type] = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReqInput,
        TokenizedEmbeddingReqInput,
        SamplingParams,
        AbortReq,
        FlushCacheReqInput,
        FlushCacheReqOutput,
        GetLoadReqInput,
        GetLoadReqOutput,
        ProfileReq,
        ProfileReqOutput,
        LoadLoRAAdapterReqInput,
        UnloadLoRAAdapterReqInput,
        LoRAUpdateOutput,
        UpdateWeightFromDiskReqInput,
        UpdateWeightFromDiskReqOutput,
        UpdateWeightsFromTensorReqInput,
        UpdateWeightsFromTensorReqOutput,
        GetWeightsByNameReqInput,
        GetWeightsByNameReqOutput,
        ClearDecodeStatusReq,
        FreezeGCReq,
        SchedulerSnapshotOut,
        TpBroadcastInput,
        BatchTokenIDOutput,
        BatchStrOutput,
        BatchEmbeddingOutput,
    )
}


# the JSON part of a frame ends at its first newline (json.dumps escapes every newline inside a
# string, and writes none between items), and is padded with spaces so that the raw part starts
# 8-byte aligned in the received bytes (numpy then reads the rows in place, aligned)
_TAIL_SEP = b"\n"
_ALIGN = 8


def _message_fields(obj: Any, tail: List[np.ndarray]) -> Dict[str, Any]:
    """json's hook for what it cannot encode itself: a registered message becomes a tagged dict.

    json's C encoder walks the lists, dicts and numbers; only the message dataclasses (the
    top one and any nested one) come through here, one level at a time. A HiddenStateRows puts its
    rows on `tail` (raw little-endian float32, after the JSON) and leaves their place in the JSON.
    """
    if isinstance(obj, HiddenStateRows):
        rows = np.ascontiguousarray(obj.rows, dtype="<f4")
        if rows.ndim != 2:
            raise TypeError(f"HiddenStateRows.rows must be [rows, H], got shape {rows.shape}")
        offset = sum(_aligned(a.nbytes) for a in tail)
        if rows.size:  # (an empty one has no bytes: decode makes it from its shape)
            tail.append(rows)
        return {"__type__": "HiddenStateRows", "prompt_rows": obj.prompt_rows, "shape": list(rows.shape), "offset": offset}
    if isinstance(obj, bytes):  # (a safetensors file: raw after the JSON, as hidden states' rows)
        offset = sum(_aligned(a.nbytes) for a in tail)
        if obj:
            tail.append(np.frombuffer(obj, dtype=np.uint8))  # (a view: b"".join copies it once, into the frame)
        return {"__type__": "bytes", "size": len(obj), "offset": offset}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if name not in _MESSAGE_TYPES:
            raise TypeError(f"{name} is not a registered io_struct message type")
        return {"__type__": name, **{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}}
    raise TypeError(f"cannot send a {type(obj).__name__} across a process boundary")


def _aligned(nbytes: int) -> int:
    return nbytes + (-nbytes) % _ALIGN


def _message_from_fields(obj: Dict[str, Any], data: bytes, tail_start: int) -> Any:
    """json's hook for every decoded object: a tagged dict becomes its message dataclass; a
    HiddenStateRows reads its rows in place from the frame's raw part (no copy)."""
    name = obj.get("__type__")
    if name is None:
        return obj
    if name == "HiddenStateRows":
        shape, offset = obj["shape"], obj["offset"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d >= 0 for d in shape)):
            raise TypeError(f"a malformed HiddenStateRows: shape {shape!r}")
        count = shape[0] * shape[1]
        if count == 0:  # (no bytes were sent for it)
            return HiddenStateRows(np.empty(shape, dtype=np.float32), obj["prompt_rows"])
        if tail_start < 0:
            raise TypeError("a HiddenStateRows with rows in a frame without a raw part")
        # (frombuffer checks the bounds: a bad offset is a ValueError, never a read outside the frame)
        rows = np.frombuffer(data, dtype="<f4", count=count, offset=tail_start + offset).reshape(shape)
        return HiddenStateRows(rows, obj["prompt_rows"])
    if name == "bytes":
        size, offset = obj["size"], obj["offset"]
        if not (type(size) is int and type(offset) is int and size >= 0 and offset >= 0):
            raise TypeError(f"malformed bytes: size {size!r}, offset {offset!r}")
        if size == 0:
            return b""
        start = tail_start + offset
        if tail_start < 0 or start + size > len(data):
            raise TypeError("bytes past the end of the frame (or a frame without a raw part)")
        return data[start : start + size]
    cls = _MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise TypeError(f"{name!r} is not a registered io_struct message type")
    return cls(**{k: v for k, v in obj.items() if k != "__type__"})


def encode(msg: Any) -> bytes:
    """Serialize a registered message: JSON (-inf logprobs survive as `-Infinity`), then, when it
    carries hidden states, a newline and their raw float32 rows.

    Floats are written as Python's repr, the shortest text that reads back as the same double:
    a float32 (or bfloat16) value from `tensor.tolist()` is exactly a double, so logprobs
    arrive bit for bit (tests/test_io_struct.py), at ~20 characters a number. Hidden states are
    thousands of numbers a token: as raw bytes they cost a copy, not ~0.8 us a number each way
    (tests/test_io_struct.py; the numbers in docs/server.md, "Hidden states").

    Every output token of every running request crosses two process boundaries, so this
    runs in C (json's encoder) except for the per-message hook above.
    """
    if not (dataclasses.is_dataclass(msg) and not isinstance(msg, type)):
        raise TypeError(f"cannot send a {type(msg).__name__} across a process boundary")
    tail: List[np.ndarray] = []
    head = json.dumps(msg, default=lambda obj: _message_fields(obj, tail), separators=(",", ":")).encode()
    if not tail:
        return head
    pad = b" " * ((-(len(head) + 1)) % _ALIGN)
    parts: List[Any] = [head, pad, _TAIL_SEP]
    for rows in tail:  # (memoryviews: b"".join copies each array once, into the frame)
        parts.append(memoryview(rows).cast("B"))
        parts.append(b"\0" * ((-rows.nbytes) % _ALIGN))
    return b"".join(parts)


def decode(data: bytes) -> Any:
    split = data.find(_TAIL_SEP)
    head = data if split < 0 else data[:split]
    obj = json.loads(head, object_hook=lambda fields: _message_from_fields(fields, data, split + 1 if split >= 0 else -1))
    if not dataclasses.is_dataclass(obj):
        raise TypeError("received a message that is not a registered io_struct type")
    return obj
