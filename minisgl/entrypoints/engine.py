"""Engine: the whole serving stack in one process, no sockets (DESIGN.md).

Where it sits: the in-process twin of the server. It runs the same objects the server's
processes run, with direct calls in place of ZMQ:

    generate / add_request --tokenize_one_request--> TokenizedGenerateReqInput
        --Scheduler.process_input_requests--> Req in waiting_queue
    step(): Scheduler.run_step() --pop_outputs--> BatchTokenIDOutput
        --DetokenizerManager.handle_batch_token_id_out--> BatchStrOutput --> per-rid state

`step()` runs exactly one scheduler iteration and returns `snapshot()` (docs/snapshot.md),
so a notebook can watch the scheduler decide, one batch at a time. An Engine built with
`is_embedding=True` serves an embedding model: `encode()` (SGLang's) sends EmbeddingReqInputs
down the same chain and returns {"embedding", "meta_info"}; generate() is refused there, and
encode() everywhere else.
Owns: the ModelRunner, the Scheduler, the DetokenizerManager, one tokenizer, the LoRARegistry
(with LoRA on), and a `_ReqState` per request submitted and not yet collected. With `tp_size=N`
it is rank 0, and owns ranks 1..N-1 as child processes (engine_tp.py): each change of its
scheduler goes to them first (`_handover`). Every call runs in its caller's
thread; calls from several threads take turns (one lock: a step, or a call, at a time).

Results have the TokenizerManager's shape (docs/engine.md): `meta_info` always carries
`output_token_logprobs` [(logprob, id, None)] and `output_top_logprobs` [[(logprob, id,
None)] * k], the prompt's `input_token_logprobs` [(logprob | None, id, None)] and
`input_top_logprobs`, and `output_token_ids_logprobs` / `input_token_ids_logprobs` (the ids
of token_ids_logprob at each position), empty unless asked for. Entries are SGLang's
triples; the text stays None here (the server fills it with return_text_in_logprobs). With
return_hidden_states (and enable_return_hidden_states=True), `meta_info["hidden_states"]` holds
the final-norm hidden states in SGLang's layout: the prompt's rows, then one per decode step. A
streamed chunk carries everything so far, as SGLang's (only what it adds with
incremental_streaming_output), a final result the whole lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from minisgl.entrypoints.engine_tp import EngineTpRanks, RankDiedError
from minisgl.lora.lora_registry import LORA_NOT_ENABLED, LoRARegistry
from minisgl.managers.io_struct import (
    LOGPROB_META_KEYS, AbortReq, BatchEmbeddingOutput, BatchStrOutput, EmbeddingReqInput, FlushCacheReqInput, GenerateReqInput,
    GetWeightsByNameReqInput, LoRAUpdateOutput, ProfileReq, ProfileReqType, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
    check_logprob_args, expand_samples, hidden_states_of, logprobs_of, new_rid, prefix_warmups, spec_meta_info,
)  # fmt: skip
from minisgl.managers.tokenization import (
    check_custom_logit_processor, check_dimensions, check_extra_key, check_priority, check_return_hidden_states,
    resolve_lora_ids, tokenize_one_request, validate_context_length,
)  # fmt: skip
from minisgl.managers.tokenizer_manager_score_mixin import build_score_request, check_apply_softmax, score_param_error, scores_from_outputs
from minisgl.sampling.sampling_params import SamplingParams
from minisgl.server_args import SERVER_ONLY_FIELDS, SGLANG_OPTIONS_ALREADY_SO, SGLANG_OPTIONS_REFUSED, ServerArgs, resolve_server_args
from minisgl.utils import ParamError

logger = logging.getLogger("minisgl")

Prompt = Union[str, List[str], None]
InputIds = Union[List[int], List[List[int]], None]
AnyTokenized = Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput]

# a call of the kind this Engine does not run (the server's twins: tokenizer_manager.py)
GENERATE_ON_EMBEDDING_ENGINE = (
    "This Engine serves an embedding model (is_embedding=True): call encode() for embeddings; generate() and "
    "add_request() need an Engine built without is_embedding"
)
# what the Engine adds to SGLang's refusal (tokenization.RETURN_HIDDEN_STATES_DISABLED), which names the server's flag
RETURN_HIDDEN_STATES_ENGINE_HINT = " (The Engine's argument: Engine(..., enable_return_hidden_states=True).)"
SCORE_ON_EMBEDDING_ENGINE = (
    "This Engine serves an embedding model (is_embedding=True): its model ends in a Pooler, not an LM head, so it has "
    "no next-token probabilities to score; score() needs an Engine built without is_embedding"
)
ENCODE_ON_GENERATION_ENGINE = (
    "This model does not appear to be an embedding model by default: build the Engine with is_embedding=True "
    "(the server: --is-embedding) to call encode()"
)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an Engine method holding the Engine's lock (reentrant: generate() steps inside it)."""

    @functools.wraps(method)
    def wrapper(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._calls_in_progress += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                self._calls_in_progress -= 1

    return wrapper


@dataclass
class _ReqState:
    """What the user will get back for one rid (the Engine's ReqState)."""

    rid: str
    created_time: float
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finished: bool = False
    meta_info: Dict[str, Any] = field(default_factory=dict)  # the latest message's, logprobs left out
    # accumulated over every message: the scheduler emits at least every 50 tokens even
    # for a non-streaming request, so one message holds only part of the answer
    logprobs: Dict[str, List[Any]] = field(default_factory=lambda: {key: [] for key in LOGPROB_META_KEYS})
    # return_hidden_states: every entry so far (meta_info["hidden_states"] of its results); None when not asked
    hidden_states: Optional[List[Any]] = None
    # a generate(stream=True) reads it: each message adds a delta to `pending`, or marks it `updated`
    streamed: bool = False
    # --incremental-streaming-output: the delta chunks not yet handed to the stream
    pending: List[Dict[str, Any]] = field(default_factory=list)
    # otherwise: whether a message came since the stream last took its (cumulative) chunk
    updated: bool = False
    # an encode() request: its answer is {"embedding", "meta_info"} (None: it ended without one, an abort)
    is_embedding: bool = False
    embedding: Optional[List[float]] = None


class Engine:
    """`Engine(model_path=None, **server_args)`: the built-in model unless a path is given."""

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any) -> None:
        from minisgl.managers.detokenizer_manager import DetokenizerManager
        from minisgl.managers.scheduler import Scheduler
        from minisgl.model_executor.model_runner import ModelRunner
        from minisgl.utils import get_tokenizer

        for name, why in SGLANG_OPTIONS_ALREADY_SO.items():  # (an SGLang script's sgl.Engine(..., enable_metrics=True))
            if kwargs.pop(name, False):
                logger.info("%s: nothing to change, %s", name, why)
        for name, why in SGLANG_OPTIONS_REFUSED.items():
            if kwargs.pop(name, None) is not None:
                raise ValueError(f"{name}: {why}")
        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        server_only = [k for k in SERVER_ONLY_FIELDS if k in kwargs and kwargs[k] != defaults[k]]
        if server_only:  # (they would be accepted and do nothing)
            raise ValueError(
                f"{', '.join(server_only)}: option(s) of `minisgl serve`'s HTTP server and processes, "
                "which the in-process Engine does not have; leave them out"
            )
        for name in ("lora_paths", "lora_target_modules"):  # (SGLang's Engine takes lists; the frozen args hold tuples)
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        args = ServerArgs(model_path=model_path, **kwargs)  # (checks every value, log_level's too)
        if "log_level" in kwargs:  # minisgl's loggers only: the application owns the handlers and their format
            logging.getLogger("minisgl").setLevel(args.log_level.upper())
        self.server_args = resolve_server_args(args)
        # One scheduler, driven by whoever calls: calls from several threads (a generate() in a
        # background thread while a notebook steps) take turns, one step or call at a time.
        self._lock = threading.RLock()
        self._calls_in_progress = 0  # locked calls running (nested ones, and a heartbeat, count too); changed under the lock
        # rids of streams dropped while a call of this thread ran (a garbage-collector finalizer):
        # aborted and forgotten at the start of the next step, never from inside the running call
        self._dropped: List[str] = []
        # why a step stopped half-way, leaving the scheduler in a state nothing can trust
        self._broken: Optional[str] = None
        self._closed = False
        self.rid_to_state: Dict[str, _ReqState] = {}
        # tp_size > 1: this process is rank 0, the other ranks are child processes that follow it
        # (entrypoints/engine_tp.py); every change of the scheduler goes to them first (_handover)
        self._tp: Optional[EngineTpRanks] = EngineTpRanks(self.server_args, self._lock) if self.server_args.tp_size > 1 else None
        def build() -> Any:
            model_runner = ModelRunner(self.server_args, tp_group=self._tp.group if self._tp is not None else None)
            tokenizer = get_tokenizer(self.server_args.tokenizer_path, self.server_args.trust_remote_code)
            return model_runner, tokenizer, Scheduler(self.server_args, model_runner, tokenizer)

        try:
            # tp_size > 1: built while this thread watches the other ranks (its collectives wait on them)
            built = build() if self._tp is None else self._tp.while_watching(build, "minisgl-tp-build")
            self.model_runner, self.tokenizer, self.scheduler = built
            if self._tp is not None:
                turn = weakref.WeakMethod(self._heartbeat_turn)  # (the heartbeat thread must not keep a forgotten Engine alive)
                self._tp.wait_ready(self.scheduler, lambda: (turn() or _no_turn)())
        except BaseException as e:
            if self._tp is None:
                raise
            failed_at = time.time()
            try:
                if not isinstance(e, ValueError):  # (a setting refused: every rank refuses it alike, rank 0 says it)
                    self._tp.raise_rank_failure(failed_at)  # a rank that failed first is the error to see (rank 0's is its echo)
            except RankDiedError as failed:
                raise failed from e
            finally:
                self._tp.close()
            raise
        if self._tp is not None:  # (the ranks stop even when the caller forgets shutdown(); at exit, engine_tp's hook)
            weakref.finalize(self, self._tp.close).atexit = False
        self.detokenizer = DetokenizerManager(self.server_args)
        self.vocab_size: int = self.model_runner.model_config.vocab_size
        self.context_len: int = self.model_runner.model_config.context_len
        # the adapters a request may name (lora_paths, then load_lora_adapter); None: LoRA off
        self.lora_registry = LoRARegistry(self.server_args.lora_adapters or ()) if self.server_args.enable_lora else None
        # the served weights' name (SGLang's weight_version): every result's meta_info; a weight update may change it
        self.weight_version: str = self.server_args.weight_version
        # the rid a caller gave an n > 1 prompt -> its samples' rids (`<rid>-<j>`), for abort(rid)
        self._samples_of: Dict[str, List[str]] = {}

    # ------------------------------------------------------------------ submission
    @_locked
    def add_request(
        self,
        prompt: Optional[str] = None,
        sampling_params: Optional[Dict[str, Any]] = None,
        input_ids: Optional[List[int]] = None,
        stream: bool = False,
        rid: Optional[str] = None,
        return_logprob: Optional[bool] = False,
        top_logprobs_num: Optional[int] = 0,
        logprob_start_len: Optional[int] = -1,
        token_ids_logprob: Optional[List[int]] = None,
        priority: Optional[int] = None,
        custom_logit_processor: Optional[Any] = None,
        return_hidden_states: bool = False,
        lora_path: Optional[str] = None,
        extra_key: Optional[str] = None,
    ) -> str:
        """Tokenize one request and queue it in the scheduler; returns its rid.

        priority: with enable_priority_scheduling, how important the request is (docs/scheduler.md).
        custom_logit_processor: with enable_custom_logit_processor, a CustomLogitProcessor subclass
        (or its to_str()) that edits the logits before sampling; it reads
        sampling_params["custom_params"] (docs/server.md, "Custom logit processors").

        With return_logprob, logprob_start_len >= 0 asks for the prompt's logprobs from that
        position on too (meta_info["input_token_logprobs"]); -1 for output logprobs only.
        token_ids_logprob: ids whose logprobs every output token (and scored prompt position)
        reports, in meta_info["output_token_ids_logprobs"] ("input_token_ids_logprobs").
        return_hidden_states: with enable_return_hidden_states, the final-norm hidden states in
        meta_info["hidden_states"] (docs/engine.md).
        lora_path: the name of a loaded adapter (lora_paths, or load_lora_adapter) to run the request
        with (None: the base model).
        extra_key: the request's own radix-tree namespace (SGLang's; a tenant's cache salt): it
        reuses cached K/V only of requests with the same key (None or "": no key)."""
        self._check_open()
        if self.server_args.is_embedding:
            raise ValueError(GENERATE_ON_EMBEDDING_ENGINE)
        if not _check_prompt(prompt, input_ids):
            raise ValueError("add_request takes a single prompt; pass a list to generate()")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"`rid` must be a string, got {type(rid).__name__}")
        if SamplingParams.from_dict(sampling_params).n != 1:  # (types checked here first)
            raise ValueError("add_request takes one request; use generate(..., sampling_params={'n': k}) for n > 1")
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=dict(sampling_params or {}), rid=rid or new_rid(),
            return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, stream=stream, priority=priority,
            custom_logit_processor=_processor_str(custom_logit_processor), return_hidden_states=return_hidden_states,
            lora_path=lora_path, extra_key=extra_key,
        )  # fmt: skip
        obj.normalize_batch_and_arguments()
        resolve_lora_ids(obj, self.lora_registry)
        check_extra_key(obj)
        check_priority(priority, self.server_args.enable_priority_scheduling)
        check_custom_logit_processor(obj, self.server_args.enable_custom_logit_processor)
        check_return_hidden_states(obj, self.server_args.enable_return_hidden_states, RETURN_HIDDEN_STATES_ENGINE_HINT)
        tokenized = self._tokenize(obj)
        try:
            self._enqueue([tokenized])
        except BaseException:  # Ctrl-C held to the end of queueing: the caller never got the rid
            self._release_after_error([tokenized.rid])
            raise
        return tokenized.rid

    def _tokenize(self, obj: Union[GenerateReqInput, EmbeddingReqInput]) -> AnyTokenized:
        """Every check the server makes on one single request, nothing registered yet (ValueError on bad input)."""
        self._check_rid_free(obj.rid)
        tokenized = tokenize_one_request(self.tokenizer, obj, self.vocab_size)
        validate_context_length(
            tokenized, self.context_len, self.server_args.allow_auto_truncate, self.scheduler.max_req_input_len
        )
        return tokenized

    def _warm_prefixes(self, warmups: List[AnyTokenized]) -> None:
        """Prefill each n > 1 prompt once, stepping until done, before its samples are queued
        (io_struct.prefix_warmups, as the server's TokenizerManager does): they then find it cached."""
        rids = [w.rid for w in warmups]
        try:
            self._enqueue(warmups)
            while not all(self.rid_to_state[r].finished for r in rids):
                self.step(snapshot=False)
        except BaseException:
            self._release_after_error(rids)
            raise
        for rid in rids:
            del self.rid_to_state[rid]

    def _check_rid_free(self, rid: str) -> None:
        """A rid in use (a request's, or an n > 1 request's whose samples run) cannot name another."""
        if rid in self.rid_to_state and self.rid_to_state[rid].finished:
            raise ValueError(f"rid {rid!r} finished, but its result was not collected: engine.get_result({rid!r}) frees the rid")
        if rid in self.rid_to_state or rid in self._samples_of:
            raise ValueError(f"rid {rid!r} is already in flight")

    def _enqueue(self, requests: List[AnyTokenized], streamed: bool = False) -> None:
        """Register and queue checked requests (all of one call at once: none is queued if any is bad)."""
        now = time.perf_counter()
        with _signals_held_until_the_end():  # Ctrl-C while queueing would leave requests half-queued
            for tokenized in requests:
                self.rid_to_state[tokenized.rid] = _ReqState(
                    rid=tokenized.rid, created_time=now, streamed=streamed,
                    is_embedding=isinstance(tokenized, TokenizedEmbeddingReqInput),
                    hidden_states=[] if getattr(tokenized, "return_hidden_states", False) else None,
                )  # fmt: skip
            self._guarded(self._handover, requests)
            self._drain_outputs()  # a request rejected at the gate (queue full) finishes here

    @_locked
    def _submit(
        self, prompt: Prompt, sampling_params: Any, input_ids: InputIds, stream: bool, return_logprob: Any,
        top_logprobs_num: Any, logprob_start_len: Any, token_ids_logprob: Any, rid: Any = None, priority: Any = None,
        custom_logit_processor: Any = None, return_hidden_states: Any = False, lora_path: Any = None,
        extra_key: Any = None,
    ) -> tuple[List[str], bool]:
        """Fan a generate() call out into single requests (n copies each). Returns (rids, single).

        Every request is checked before any is queued, as the server's _validate_request_shape
        does: a bad entry in a batch raises and leaves nothing behind.
        """
        self._check_open()
        if self.server_args.is_embedding:
            raise ValueError(GENERATE_ON_EMBEDDING_ENGINE)
        _check_prompt(prompt, input_ids)
        if not isinstance(sampling_params, list):  # its type, before a batch copies it per prompt
            SamplingParams.from_dict(sampling_params)
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob,
            stream=stream, rid=rid, priority=priority, custom_logit_processor=_processor_str(custom_logit_processor),
            return_hidden_states=return_hidden_states, lora_path=lora_path, extra_key=extra_key,
        )  # fmt: skip
        check_priority(priority, self.server_args.enable_priority_scheduling)
        obj.normalize_batch_and_arguments()  # single or batch, lists per prompt, the same n for all
        resolve_lora_ids(obj, self.lora_registry)
        check_extra_key(obj)
        check_custom_logit_processor(obj, self.server_args.enable_custom_logit_processor)
        check_return_hidden_states(obj, self.server_args.enable_return_hidden_states, RETURN_HIDDEN_STATES_ENGINE_HINT)
        obj.check_rids()  # the server's rules (in-process, without its length bound)
        for single in obj.singles():  # before any prompt is tokenized
            check_logprob_args(
                single.return_logprob, single.logprob_start_len, single.top_logprobs_num,
                token_ids_logprob=single.token_ids_logprob,
            )  # fmt: skip
            n = SamplingParams.from_dict(single.sampling_params).n  # types and unknown keys, before anything is queued
            if n < 1:
                raise ValueError(f"n must be >= 1, got {n}")
        # the server's fan-out: n copies of each prompt, sample j with seed + j
        samples = expand_samples(obj)
        for parent in {s.parent_rid for s in samples if s.req.rid != s.parent_rid}:  # (before anything is queued)
            self._check_rid_free(parent)
        requests = [self._tokenize(sample.req) for sample in samples]
        self._warm_prefixes(prefix_warmups(samples, requests))
        try:
            self._enqueue(requests, streamed=stream)
        except BaseException:  # Ctrl-C held to the end of queueing: nobody will collect these
            self._release_after_error([r.rid for r in requests])
            raise
        for sample in samples:
            if sample.req.rid != sample.parent_rid:
                self._samples_of.setdefault(sample.parent_rid, []).append(sample.req.rid)
        return [r.rid for r in requests], obj.is_single and len(requests) == 1

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: Optional[Union[bool, List[bool]]] = False,  # (None: SGLang's default, as False)
        top_logprobs_num: Optional[Union[int, List[int]]] = 0,
        logprob_start_len: Optional[Union[int, List[int]]] = -1,
        token_ids_logprob: Optional[Union[List[int], List[Optional[List[int]]]]] = None,
        rid: Optional[Union[str, List[str]]] = None,
        priority: Optional[int] = None,
        custom_logit_processor: Optional[Any] = None,
        return_hidden_states: Union[bool, List[bool]] = False,
        lora_path: Optional[Union[str, List[Optional[str]]]] = None,
        extra_key: Optional[Union[str, List[Optional[str]]]] = None,
    ) -> Any:
        """SGLang's shapes: one prompt -> dict; a list (or n > 1) -> list; stream -> iterator.

        logprob_start_len and token_ids_logprob (with return_logprob): as add_request's. For a
        list of prompts each logprob field is one value for all, or a list of one per prompt.
        rid: the request's id (a list of one per prompt for a batch), for abort(rid) from another
        thread; generated when left out. priority: with enable_priority_scheduling, how important
        the request is (all prompts of a batch; docs/scheduler.md). custom_logit_processor: with
        enable_custom_logit_processor, a CustomLogitProcessor subclass or its to_str() (one for all
        prompts, or a list of one per prompt) that edits the logits before sampling, reading each
        prompt's sampling_params["custom_params"] (docs/server.md, "Custom logit processors").
        return_hidden_states (with enable_return_hidden_states=True; one for all prompts or one per
        prompt): meta_info["hidden_states"], SGLang's list: the prompt's final-norm rows [n, H] (the
        tokens the prefill computed: after a radix hit, only the uncached ones), then one [H] row per
        decode step (docs/engine.md). lora_path (with LoRA on): the name of the loaded adapter each
        prompt runs with, one for all or one per prompt (None: the base model). extra_key: each prompt's own
        radix-tree namespace (SGLang's; a tenant's cache salt), one for all or one per prompt: a
        prompt reuses cached K/V only of requests with the same key and adapter (docs/engine.md)."""
        rids, single = self._submit(
            prompt, sampling_params, input_ids, stream, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, token_ids_logprob=token_ids_logprob,
            rid=rid, priority=priority, custom_logit_processor=custom_logit_processor,
            return_hidden_states=return_hidden_states, lora_path=lora_path, extra_key=extra_key,
        )  # fmt: skip
        if stream:
            chunks = self._stream(rids, single)
            next(chunks)  # enter its try: from here, even an iterator dropped unread releases its requests
            return chunks
        try:
            while not self._all_finished(rids):
                self.step(snapshot=False)
        except BaseException:
            # Ctrl-C in a notebook (or an error): abort what is left, so nothing keeps decoding
            # unseen in later calls
            self._release_after_error(rids)
            raise
        results = _refused_raises(self._pop_results(rids))
        return results[0] if single else results

    def encode(self, prompt: Prompt = None, input_ids: InputIds = None, dimensions: Optional[int] = None) -> Any:
        """An embedding model's embeddings (is_embedding=True; SGLang's Engine.encode): one prompt
        (text, or input_ids) -> {"embedding": [float], "meta_info": {...}}; a list of prompts -> a
        list of them, in order. Each embedding is the final-norm hidden state at the prompt's last
        token, L2-normalised; `dimensions` keeps its first d numbers (normalised again), for a model
        whose config.json declares Matryoshka sizes. meta_info: id, finish_reason, prompt_tokens,
        cached_tokens (prompt tokens found in the radix cache), e2e_latency and the TTFT split (ms)."""
        rids, single = self._submit_embedding(prompt, input_ids, dimensions)
        try:
            while not self._all_finished(rids):
                self.step(snapshot=False)
        except BaseException:  # Ctrl-C (or an error): nothing may keep running unseen in later calls
            self._release_after_error(rids)
            raise
        results = _refused_raises(self._pop_results(rids))
        for i, out in enumerate(results):
            if out["embedding"] is None:  # aborted before its prompt ran (a full --max-queued-requests queue: a 503)
                reason = out["meta_info"]["finish_reason"] or {}
                raise RuntimeError(f"The embedding of prompt {i} was not computed: {reason.get('message') or 'aborted'}")
        return results[0] if single else results

    def score(
        self, query: Any = None, items: Any = None, label_token_ids: Optional[List[int]] = None,
        apply_softmax: bool = False, item_first: bool = False,
    ) -> List[List[float]]:  # fmt: skip
        """SGLang's Engine.score: for each item, the probabilities of `label_token_ids` as the next token
        after query + item (item + query with item_first), in the order of the labels. `query` a
        string with `items` a string or a list of strings, or `query` a list of ids with `items` a list
        of id lists. apply_softmax: a softmax over the labels only (they add up to 1); otherwise each
        label's probability over the whole vocabulary. No items -> []. The items are one batch of
        generate() prompts (docs/engine.md, "Scoring"); bad input raises ValueError (ParamError, with
        /v1/score's field names: a prompt too long is about `items`)."""
        obj = self._score_request(query, items, label_token_ids, apply_softmax, item_first)
        if obj is None:
            return []
        try:
            outs = self.generate(obj.text, obj.sampling_params, obj.input_ids, return_logprob=True, token_ids_logprob=obj.token_ids_logprob)
        except ParamError as e:  # (generate's names, input_ids and text: the route's instead)
            raise score_param_error(e) from None
        return scores_from_outputs(outs, obj.token_ids_logprob, apply_softmax).scores

    async def async_score(
        self, query: Any = None, items: Any = None, label_token_ids: Optional[List[int]] = None,
        apply_softmax: bool = False, item_first: bool = False,
    ) -> List[List[float]]:  # fmt: skip
        """score() for asyncio code (SGLang's async_score): the work runs as async_generate's does."""
        obj = self._score_request(query, items, label_token_ids, apply_softmax, item_first)
        if obj is None:
            return []
        try:
            outs = await self.async_generate(
                obj.text, obj.sampling_params, obj.input_ids, return_logprob=True, token_ids_logprob=obj.token_ids_logprob
            )
        except ParamError as e:
            raise score_param_error(e) from None
        return scores_from_outputs(outs, obj.token_ids_logprob, apply_softmax).scores

    def _score_request(self, query: Any, items: Any, label_token_ids: Any, apply_softmax: Any, item_first: Any) -> Optional[GenerateReqInput]:
        """The score call's checks (the server's: tokenizer_manager_score_mixin) and its batch request."""
        self._check_open()
        if self.server_args.is_embedding:
            raise ValueError(SCORE_ON_EMBEDDING_ENGINE)
        check_apply_softmax(apply_softmax)
        return build_score_request(query, items, label_token_ids, item_first, self.vocab_size)

    @_locked
    def _submit_embedding(self, prompt: Prompt, input_ids: InputIds, dimensions: Optional[int]) -> tuple[List[str], bool]:
        """Check and queue an encode() call's prompts (every one checked before any is queued)."""
        self._check_open()
        if not self.server_args.is_embedding:
            raise ValueError(ENCODE_ON_GENERATION_ENGINE)
        _check_prompt(prompt, input_ids)
        obj = EmbeddingReqInput(text=prompt, input_ids=input_ids, dimensions=dimensions)
        obj.normalize_batch_and_arguments()
        mc = self.model_runner.model_config
        check_dimensions(dimensions, mc.is_matryoshka, mc.matryoshka_dimensions, mc.hidden_size, self.server_args.served_model_name)
        requests = [self._tokenize(single) for single in obj.singles()]
        try:
            self._enqueue(requests)
        except BaseException:  # Ctrl-C held to the end of queueing: nobody will collect these
            self._release_after_error([r.rid for r in requests])
            raise
        return [r.rid for r in requests], obj.is_single

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: Optional[Union[bool, List[bool]]] = False,  # (None: SGLang's default, as False)
        top_logprobs_num: Optional[Union[int, List[int]]] = 0,
        logprob_start_len: Optional[Union[int, List[int]]] = -1,
        token_ids_logprob: Optional[Union[List[int], List[Optional[List[int]]]]] = None,
        rid: Optional[Union[str, List[str]]] = None,
        priority: Optional[int] = None,
        custom_logit_processor: Optional[Any] = None,
        return_hidden_states: Union[bool, List[bool]] = False,
        lora_path: Optional[Union[str, List[Optional[str]]]] = None,
        extra_key: Optional[Union[str, List[Optional[str]]]] = None,
    ) -> Any:
        """generate() for asyncio code (SGLang's async_generate): `await` it for the result, or
        with stream=True for an async iterator of the same chunks (the same arguments, hidden
        states included).

        The work (tokenizing, each scheduler step) runs in the event loop's default executor,
        so the loop stays free, and concurrent calls share the steps: each step advances every
        request in flight. A cancelled task (a client that went away) aborts its requests; the
        clean-up runs in the executor too (it waits for the step in progress), so the loop stays
        free for the other clients meanwhile.
        """
        loop = asyncio.get_running_loop()
        submit = functools.partial(
            self._submit, prompt, sampling_params, input_ids, stream, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, token_ids_logprob=token_ids_logprob,
            rid=rid, priority=priority, custom_logit_processor=custom_logit_processor,
            return_hidden_states=return_hidden_states, lora_path=lora_path, extra_key=extra_key,
        )  # fmt: skip
        submitted = loop.run_in_executor(None, submit)
        try:
            # shielded: a cancel here cannot stop the submit, which runs on in its thread; the
            # future then still tells what it queued, for the release below
            rids, single = await asyncio.shield(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(self._release_queued_by)
            raise
        if stream:
            chunks = self._async_stream(rids, single)
            await chunks.__anext__()  # into its try: from here even an iterator dropped unread releases its requests
            return chunks
        try:
            while not await loop.run_in_executor(None, self._step_unless_finished, rids):
                pass
        except BaseException:  # cancelled, or a step failed: nothing may keep decoding unseen
            await self._release_off_the_loop(self._release_after_error, rids)
            raise
        results = _refused_raises(await loop.run_in_executor(None, self._pop_results, rids))
        return results[0] if single else results

    async def _release_off_the_loop(self, release: Callable[[List[str]], None], rids: List[str]) -> None:
        """Run a release in the executor: it waits for the step in progress and steps the aborts,
        which on the loop's thread froze every other client for as long."""
        loop = asyncio.get_running_loop()
        try:
            released = loop.run_in_executor(None, release, rids)
        except RuntimeError:  # asyncio.run is shutting its executor down: here, then
            release(rids)
            return
        await asyncio.shield(released)  # (a second cancel does not stop it half-way)

    def _release_queued_by(self, submitted: "asyncio.Future[Any]") -> None:
        """A submit whose caller was cancelled while it ran: release what it queued (in the executor)."""
        if not submitted.cancelled() and submitted.exception() is None:
            rids, _ = submitted.result()
            try:
                asyncio.get_running_loop().run_in_executor(None, self._release_after_error, rids)
            except RuntimeError:  # asyncio.run is shutting its executor down: release here, then
                self._release_after_error(rids)

    async def _async_stream(self, rids: List[str], single: bool) -> AsyncIterator[Dict[str, Any]]:
        """_stream's twin for async_generate: the same chunks; the steps run in the executor."""
        loop = asyncio.get_running_loop()
        try:
            yield {}  # consumed by async_generate()
            while True:
                ready, finished = await loop.run_in_executor(None, self._take_chunks, rids, single)
                for chunk in _refused_raises(ready):
                    yield chunk
                if finished:
                    break
                await loop.run_in_executor(None, self._step_unless_finished, rids)
        finally:
            await self._release_off_the_loop(self._release_dropped_stream, rids)

    @_locked
    def _step_unless_finished(self, rids: List[str]) -> bool:
        """One step unless every rid finished (checked under the lock, so no step is wasted); finished?"""
        if self._all_finished(rids):
            return True
        self.step(snapshot=False)
        return self._all_finished(rids)

    @_locked
    def _pop_results(self, rids: List[str]) -> List[Dict[str, Any]]:
        return [self._pop_result(r) for r in rids]

    @_locked
    def _all_finished(self, rids: List[str]) -> bool:
        self._check_open()  # shutdown() from another thread says so, not "collected elsewhere"
        return all(self._state_of(rid).finished for rid in rids)

    def _state_of(self, rid: str) -> _ReqState:
        """The state of a request this call is waiting for; a clear error if another call took it."""
        state = self.rid_to_state.get(rid)
        if state is None:
            raise RuntimeError(
                f"request {rid!r} was collected elsewhere (get_result, or the widget's Reset) while this call waited for it"
            )
        return state

    def _stream(self, rids: List[str], single: bool) -> Iterator[Dict[str, Any]]:
        """Chunks as the scheduler produces them: SGLang's, each with the text, output_ids and logprob
        lists so far (one chunk for all the messages since the last read, as SGLang's latest
        `out_list` entry), or with --incremental-streaming-output what each message adds.

        A caller that stops early (break, close(), dropping the iterator, even before its first
        chunk) aborts the requests still running and steps until the scheduler has let them go,
        so their KV is freed and the engine is idle again, as the server does when a client
        disconnects. generate() consumes the first, empty yield, so that a generator that was
        never read already sits inside the try and runs its finally when it is dropped.
        """
        try:
            yield {}  # consumed by generate()
            while True:
                ready, finished = self._take_chunks(rids, single)  # (the lock is not held while yielding)
                for chunk in _refused_raises(ready):
                    yield chunk
                    if self._closed:  # shutdown() ran while the caller held this chunk
                        raise RuntimeError("the Engine was shut down while this stream was open; its requests were aborted")
                if finished:
                    break
                self.step(snapshot=False)
        finally:
            self._release_dropped_stream(rids)

    @_locked
    def _take_chunks(self, rids: List[str], single: bool) -> tuple[List[Dict[str, Any]], bool]:
        """The chunks a stream has not handed out yet (with "index" for a list), and whether it is done."""
        if self._closed:  # (a stream never read lands here after shutdown())
            raise RuntimeError("the Engine was shut down while this stream was open; its requests were aborted")
        ready: List[Dict[str, Any]] = []
        for index, rid in enumerate(rids):
            state = self._state_of(rid)
            if self.server_args.incremental_streaming_output:
                chunks, state.pending = state.pending, []
            else:  # everything so far, once however many messages came since: SGLang's latest out_list entry
                chunks, state.updated = ([self._full_output(state)] if state.updated else []), False
            ready += [chunk if single else {**chunk, "index": index} for chunk in chunks]
        return ready, all(self.rid_to_state[r].finished for r in rids)

    def _release_dropped_stream(self, rids: List[str]) -> None:
        """A stream's end: release its requests now, or at the next step if a call is running here.

        The garbage collector finalizes a stream kept alive by a reference cycle (an exception
        that holds its frame) whenever it runs, which can be in the middle of this thread's own
        step: releasing there would run a step inside the step. The lock is reentrant, so only
        `_calls_in_progress` tells this thread's running call from a free lock.
        """
        if self._closed or self._broken:  # (shutdown() aborted and forgot every request already)
            return
        if not self._lock.acquire(blocking=False):  # another thread's call: wait for it, then release
            self._release(rids)
            return
        try:
            if self._calls_in_progress:  # inside a call of this very thread
                self._dropped.extend(rids)
                return
        finally:
            self._lock.release()
        self._release(rids)

    @contextlib.contextmanager
    def _heartbeat_turn(self) -> Iterator[bool]:
        """The tensor-parallel heartbeat's turn (TpLeader.start_heartbeat): True with the Engine's
        lock, never waiting for it (a call is running: it broadcasts at each step itself), and
        counted as a call in progress, so that a stream the garbage collector finalizes in the
        heartbeat's thread mid-beat is released at the next step (_dropped), not inside the beat."""
        if not self._lock.acquire(blocking=False):
            yield False
            return
        self._calls_in_progress += 1
        try:
            yield True
        finally:
            self._calls_in_progress -= 1
            self._lock.release()

    def _release_after_error(self, rids: List[str]) -> None:
        """generate()'s clean-up when it is interrupted: nothing to do if the Engine is closed or broken
        (then the original exception is the one to see)."""
        if not self._closed and not self._broken:
            self._release(rids)

    @_locked
    def _release(self, rids: List[str]) -> None:
        """Abort what a caller left unfinished, step until the scheduler let it go, forget it all."""
        # (a rid collected elsewhere meanwhile, by get_result or the widget's Reset, is gone already)
        unfinished = [r for r in rids if r in self.rid_to_state and not self.rid_to_state[r].finished]
        try:
            for rid in unfinished:
                self.abort(rid)
            # a running request is aborted at its next forward (SGLang's method 3)
            while not all(self.rid_to_state[r].finished for r in unfinished):
                if self.scheduler.is_idle():  # nothing left that could ever finish them: do not spin
                    logger.warning("requests %s were lost by the scheduler; forgetting them", unfinished)
                    break
                self.step(snapshot=False)
        finally:  # (a second Ctrl-C during these steps: the states go all the same)
            for rid in rids:
                self.rid_to_state.pop(rid, None)
                self._forget_sample(rid)

    def _forget_sample(self, rid: str) -> None:
        """Drop a collected sample from its parent rid's list (and the parent when it was the last)."""
        parent = rid.rpartition("-")[0]
        samples = self._samples_of.get(parent)
        if samples is not None and rid in samples:
            samples.remove(rid)
            if not samples:
                del self._samples_of[parent]

    # ------------------------------------------------------------------ stepping
    @_locked
    def step(self, snapshot: bool = True) -> Optional[Dict[str, Any]]:
        """One scheduler iteration; returns the snapshot of the scheduler after it.

        `snapshot=False` skips building the snapshot (generate() and run_until_idle() do,
        so they pay nothing for the visualizer's data) and returns None.
        """
        self._check_open()
        with _signals_held_until_the_end():  # Ctrl-C lands after the step, on a whole scheduler
            aborts: List[Any] = []
            if self._dropped:  # streams dropped inside an earlier call: their requests go now
                dropped, self._dropped = self._dropped, []
                for rid in dropped:
                    state = self.rid_to_state.pop(rid, None)  # (their later outputs are ignored)
                    self._forget_sample(rid)
                    if state is not None and not state.finished:
                        aborts.append(AbortReq(rid=rid))  # a running one: at this step's forward
            self._guarded(self._run_one_step, aborts)
        return self.scheduler.snapshot() if snapshot else None

    def _run_one_step(self, aborts: List[AbortReq]) -> None:
        self._handover(aborts, run_step=True, apply=self._abort_locally)

    def _abort_locally(self, aborts: List[AbortReq]) -> List[Any]:
        for msg in aborts:  # (what process_input_requests does with them, without its other dispatch)
            self.scheduler.abort_request(msg)
        return []

    def _handover(self, msgs: List[Any], run_step: bool = False, apply: Optional[Callable[[List[Any]], List[Any]]] = None) -> List[Any]:
        """Give the scheduler these messages (`apply`: process_input_requests by default), then
        (`run_step`) one iteration: the server's loop body (process the inputs, run_step, hand the
        outputs on, then the idle check it runs before it blocks). Returns the control replies; the
        caller drains what the messages alone produced. With tp_size > 1 the other ranks get the
        same first (engine_tp.py), so that every scheduler changes alike; Ctrl-C is held to the
        end, never landing between the two."""
        with _signals_held_until_the_end():
            if self._tp is not None:
                self._tp.broadcast(msgs, run_step)
            try:
                replies = (apply or self.scheduler.process_input_requests)(msgs) if msgs else []
                if run_step:
                    self.scheduler.run_step()
                    self._drain_outputs()
                    self.scheduler.self_check_during_idle()  # as the server's loop does before it blocks
            except Exception as e:
                if self._tp is not None:  # a rank that died mid-step broke its collectives: named, not gloo's echo
                    self._tp.raise_if_a_rank_died(e)
                raise
        return replies

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a call that changes the scheduler; if it raises half-way, the Engine is broken.

        The server's scheduler process exits on such an error; here every later call says what
        happened instead of running on a scheduler whose requests and KV no longer add up.
        """
        try:
            return fn(*args)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            if self._tp is not None:  # (the other ranks may be inside this step's collectives: no shutdown frame)
                self._tp.broken = True
            raise

    @_locked
    def snapshot(self) -> Dict[str, Any]:
        self._check_open()
        return self.scheduler.snapshot()

    @_locked  # (another thread's call may add or collect a request meanwhile)
    def has_unfinished_requests(self) -> bool:
        return any(not s.finished for s in self.rid_to_state.values())

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until every submitted request finished; returns the number of steps."""
        self._check_open()
        steps = 0
        while self.has_unfinished_requests():
            if steps >= max_steps:
                raise RuntimeError(f"requests still unfinished after {max_steps} steps")
            self.step(snapshot=False)
            steps += 1
        return steps

    def _drain_outputs(self) -> None:
        trace_range = self.scheduler.trace_range  # (named after the server's processes' functions)
        for out in self.scheduler.pop_outputs():
            with trace_range("handle_batch_token_id_out"):
                text_out = self.detokenizer.dispatch(out)
            if isinstance(text_out, BatchEmbeddingOutput):  # (passed through: embeddings have no text)
                with trace_range("handle_batch_output"):
                    self._handle_embedding_output(text_out)
            elif text_out is not None:
                with trace_range("handle_batch_output"):
                    self._handle_str_output(text_out)

    def _live_states(self, out: Union[BatchStrOutput, BatchEmbeddingOutput]) -> Iterator[tuple[int, str, Any]]:
        """(index in the message, rid, its state) for each output whose request is still held (one
        collected already, e.g. aborted by the caller or released after an error, is skipped)."""
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is not None:
                yield i, rid, state

    def _handle_embedding_output(self, out: BatchEmbeddingOutput) -> None:
        """Each finished encode() request's one answer (TokenizerManager._handle_embedding_output's twin)."""
        now = time.perf_counter()
        for i, rid, state in self._live_states(out):
            state.embedding = out.embeddings[i]
            state.finished = True
            state.meta_info = {
                "id": rid,
                "finish_reason": out.finished_reasons[i],
                "prompt_tokens": out.prompt_tokens[i],
                "cached_tokens": out.cached_tokens[i],
                "weight_version": self.weight_version,
                **(out.time_stats[i] if i < len(out.time_stats) else {}),
                "e2e_latency": now - state.created_time,
            }

    def _handle_str_output(self, out: BatchStrOutput) -> None:
        """Fill each rid's state from one message, as TokenizerManager._handle_batch_output does."""
        now = time.perf_counter()
        for i, rid, state in self._live_states(out):
            logprobs = logprobs_of(out, i)
            state.text += out.output_strs[i]
            state.output_ids.extend(out.output_ids[i])
            for key, entries in logprobs.items():
                state.logprobs[key].extend(entries)
            rows = hidden_states_of(out, i)  # (float32 rows: as Python lists here, SGLang's Engine returns lists)
            new_hidden_states = rows.as_lists() if rows is not None else []
            if state.hidden_states is not None:
                state.hidden_states.extend(new_hidden_states)
            finish = out.finished_reasons[i]
            state.meta_info = {
                "id": rid,
                "prompt_tokens": out.prompt_tokens[i],
                "weight_version": self.weight_version,
                "completion_tokens": out.completion_tokens[i],
                "cached_tokens": out.cached_tokens[i],
                **spec_meta_info(out, i),
                "finish_reason": finish,
                **(out.time_stats[i] if i < len(out.time_stats) else {}),
            }
            if finish is not None:
                state.finished = True
            state.meta_info["e2e_latency"] = (now - state.created_time) if state.finished else None
            # TTFT is the scheduler's queue + schedule + forward (prefill_finished - recv) for every
            # request, streamed or not (SGLang 0.5.23 takes prefill_finished for non-streaming ones)
            ttft_ms = state.meta_info.get("ttft_ms")
            state.meta_info["ttft"] = ttft_ms / 1e3 if ttft_ms is not None else None
            if not state.streamed:
                continue
            if self.server_args.incremental_streaming_output:  # this message's text, ids and logprobs only
                delta_meta = {**state.meta_info, **logprobs}
                if state.hidden_states is not None:
                    delta_meta["hidden_states"] = new_hidden_states
                state.pending.append({"text": out.output_strs[i], "output_ids": list(out.output_ids[i]), "meta_info": delta_meta})
            else:
                state.updated = True

    def _pop_result(self, rid: str) -> Dict[str, Any]:
        """The whole answer: all text, ids and logprobs of every message (TokenizerManager._full_output)."""
        state = self._state_of(rid)
        del self.rid_to_state[rid]
        self._forget_sample(rid)
        return self._full_output(state)

    @staticmethod
    def _full_output(state: _ReqState) -> Dict[str, Any]:
        """Everything a request has produced so far: text, ids and every logprob list (copies);
        an encode() request's embedding."""
        if state.is_embedding:
            return {"embedding": state.embedding, "meta_info": dict(state.meta_info)}
        meta = {**state.meta_info, **{key: list(entries) for key, entries in state.logprobs.items()}}
        if state.hidden_states is not None:
            meta["hidden_states"] = list(state.hidden_states)
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    @_locked
    def get_result(self, rid: str) -> Dict[str, Any]:
        """The result of a finished request started with add_request (and forget it)."""
        self._check_open()
        if rid not in self.rid_to_state:
            raise ValueError(f"no request {rid!r}: it was never added, or its result was collected already")
        if not self.rid_to_state[rid].finished:
            raise ValueError(f"request {rid!r} has not finished; call step() until it does")
        return self._pop_result(rid)

    # ------------------------------------------------------------------ control
    @_locked
    def abort(self, rid: str) -> None:
        """Abort a request (waiting, mid-chunk or running); its result carries finish type abort.

        The rid given to an n > 1 generate() aborts all its samples (`<rid>-<j>`), as on the server."""
        self._check_open()
        self._guarded(self._handover, [AbortReq(rid=one) for one in self._samples_of.get(rid, [rid])], False, self._abort_locally)
        self._drain_outputs()

    @_locked
    def load_lora_adapter(self, lora_name: str, lora_path: Union[str, "os.PathLike[str]"], pinned: bool = False) -> LoRAUpdateOutput:
        """Load a PEFT adapter while the Engine runs (SGLang's Engine.load_lora_adapter): requests may
        name it (lora_path=lora_name) from now on. Needs lora_paths, or enable_lora=True with
        max_lora_rank and lora_target_modules. ValueError says why a load is refused (a taken name,
        max_loaded_loras reached, a rank or module past those limits, not a PEFT LoRA directory,
        a bad argument; SGLang's returns the failed LoRAUpdateOutput instead); nothing changes then.
        Returns the scheduler's answer (loaded_adapters: name -> directory)."""
        self._check_open()
        lora_path = os.fspath(lora_path) if isinstance(lora_path, os.PathLike) else lora_path
        with self._lora_registry().loading(lora_name, lora_path, pinned, self.server_args.max_loaded_loras) as update:
            with _signals_held_until_the_end():  # (a Ctrl-C lands once the answer is kept: weights and name agree)
                [update.out] = self._guarded(self._handover, [update.msg])
        if not update.out.success:
            raise ValueError(update.out.error_message)
        return update.out

    @_locked
    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Unload an adapter (SGLang's Engine.unload_lora_adapter): new requests naming it are refused
        at once; those already queued or running with it finish first, as SGLang waits for them,
        so this steps the scheduler (everyone's requests advance) until none is left. Their results
        stay to collect. ValueError when no adapter of that name is loaded. Interrupted while it
        waits (Ctrl-C, an error in a step), it leaves the adapter loaded and named, and re-raises."""
        self._check_open()
        with self._lora_registry().unloading(lora_name) as update:
            lora_id = update.msg.lora_id
            while self.scheduler.reqs_of_lora(lora_id):
                self.step(snapshot=False)
            with _signals_held_until_the_end():
                replies = self._guarded(self._handover, [update.msg])
            # The scheduler holds an unload (the server's safety net) only while a request of its
            # adapter is there; the wait above left none, so it answered at once.
            assert len(replies) == 1, (
                f"the scheduler held the unload of {lora_name!r} (replies: {replies}), yet it holds one only while "
                f"a request of its adapter is there, and reqs_of_lora({lora_id!r}) was empty just before"
            )
            update.out = replies[0]
        if not update.out.success:
            raise ValueError(update.out.error_message)
        return update.out

    def _lora_registry(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise ValueError(LORA_NOT_ENABLED)
        return self.lora_registry

    @_locked
    def flush_cache(self) -> bool:
        self._check_open()
        return self._guarded(self._handover, [FlushCacheReqInput()])[0].success

    # ------------------------------------------------------------------ weights while serving
    @_locked
    def update_weights_from_disk(
        self, model_path: Union[str, "os.PathLike[str]"], load_format: Optional[str] = None, abort_all_requests: bool = False,
        weight_version: Optional[str] = None,
    ) -> Tuple[bool, str, int]:  # fmt: skip
        """Load new weights of the served model from a checkpoint directory (SGLang's
        Engine.update_weights_from_disk): the same config.json (architecture, shapes), every tensor.
        The requests in flight finish first with the old weights (this steps the scheduler until
        none is left; their results stay to collect), or are aborted with `abort_all_requests`;
        then the radix cache is flushed. Returns SGLang's (success, message, num_paused_requests);
        on a failure (a missing directory, a bad file, another model) the old weights are kept
        and `message` says why. `weight_version` names the new weights (meta_info["weight_version"])."""
        self._check_open()
        if isinstance(model_path, os.PathLike):
            model_path = os.fspath(model_path)
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path must be a checkpoint directory (a str), got {_describe(model_path)}")
        _check_update_args(load_format, abort_all_requests, weight_version)
        out = self._update_weights(UpdateWeightFromDiskReqInput(model_path, load_format, abort_all_requests, weight_version))
        return out.success, out.message, out.num_paused_requests

    @_locked
    def update_weights_from_tensor(
        self, named_tensors: Any, load_format: Optional[str] = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: Optional[str] = None,
    ) -> Tuple[bool, str]:  # fmt: skip
        """Load (name, tensor) pairs into the served model (SGLang's Engine.update_weights_from_tensor):
        names are the checkpoint's (Hugging Face) ones, through the start-up loader's mapping (q/k/v
        into qkv_proj, gate/up into gate_up_proj, each rank's slice); any subset of the model's
        tensors (one bucket of several). Requests in flight are handled as in update_weights_from_disk.
        `flush_cache=False` keeps the radix cache's K/V of the previous weights: for every bucket but
        the last, which flushes. Returns (success, message); on a failure nothing changed.
        Memory: with tp_size 1 the scheduler reads these tensors themselves (one staged copy of the
        parameters they touch); with tp_size N they go to the ranks as one safetensors file."""
        import torch

        from minisgl.models.weight_update import named_tensors_to_bytes

        self._check_open()
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        if not isinstance(named_tensors, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named_tensors
        ):
            raise ValueError("named_tensors must be a list of (name, torch.Tensor) pairs, e.g. list(model.state_dict().items())")
        if not isinstance(flush_cache, bool):
            raise ValueError(f"flush_cache must be True or False, got {_describe(flush_cache)}")
        _check_update_args(load_format, abort_all_requests, weight_version)
        if self._tp is None:  # the scheduler is in this process: it reads the caller's tensors, no copy, no bytes
            msg = UpdateWeightsFromTensorReqInput([], load_format, flush_cache, abort_all_requests, weight_version,
                                                  named_tensors=list(named_tensors))  # fmt: skip
        else:  # the other ranks' schedulers are processes: the tensors cross as safetensors bytes (io_struct)
            files = [named_tensors_to_bytes(named_tensors)] if named_tensors else []
            msg = UpdateWeightsFromTensorReqInput(files, load_format, flush_cache, abort_all_requests, weight_version)
        out = self._update_weights(msg)
        return out.success, out.message

    def _update_weights(self, msg: Union[UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput]) -> Any:
        """SGLang's model_update_lock, in one thread: the requests in flight end first (aborted with
        abort_all_requests), then the scheduler (every rank's) updates and flushes."""
        if msg.abort_all_requests and not self.scheduler.is_idle():
            self._guarded(self._handover, [AbortReq(abort_all=True)], False, self._abort_locally)
            self._drain_outputs()
        while not self.scheduler.is_idle():
            self.step(snapshot=False)
        with _signals_held_until_the_end():  # (a Ctrl-C lands once the weights and weight_version agree)
            replies = self._guarded(self._handover, [msg])
            # the scheduler holds an update only while a request is in flight; the wait above left none
            assert len(replies) == 1, f"the scheduler held a weight update with nothing in flight (replies: {replies})"
            out = replies[0]
            if out.success and msg.weight_version is not None:
                self.weight_version = msg.weight_version
                out.message += f" Weight version updated to {msg.weight_version}."
        return out

    @_locked
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> List[Any]:
        """SGLang's Engine.get_weights_by_name: the parameter of checkpoint tensor `name` (e.g.
        'model.layers.0.mlp.down_proj.weight'), its first `truncate_size` rows (a vector's values) as
        floats. With tp_size > 1, SGLang's answer: o_proj / down_proj gathered whole, any other
        tensor rank 0's slice. ValueError: a name the model has no parameter for (SGLang: None)."""
        self._check_open()
        if not isinstance(name, str):
            raise ValueError(f"name must be a str, got {_describe(name)}")
        [out] = self._guarded(self._handover, [GetWeightsByNameReqInput(name, truncate_size)])
        if out.parameter is None:
            raise ValueError(out.message)
        return out.parameter

    @_locked
    def get_load(self) -> Any:
        self._check_open()
        return self.scheduler.get_load()

    @_locked
    def start_profile(
        self, output_dir: Optional[Union[str, "os.PathLike[str]"]] = None, num_steps: Optional[int] = None,
        activities: Optional[Sequence[str]] = None,
        with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None, profile_prefix: Optional[str] = None,
        *, start_step: Optional[int] = None, profile_by_stage: bool = False, merge_profiles: bool = False,
        profile_stages: Optional[List[str]] = None,
    ) -> str:  # fmt: skip
        """Start torch.profiler on the scheduler's steps (POST /start_profile's fields; docs/engine.md).

        The trace `<output_dir>/<profile_id>-TP-0.trace.json.gz` is written by stop_profile(), or
        by the step that completes `num_steps` steps that ran a batch. Returns the scheduler's
        message (it names the file). ValueError: an argument to change; RuntimeError: already
        profiling, an output_dir that cannot be written, or torch.profiler refused to start."""
        from minisgl.managers.scheduler_profiler_mixin import refuse_unsupported_profile_args, resolve_profile_args

        self._check_open()
        refuse_unsupported_profile_args(start_step, profile_by_stage, merge_profiles, profile_stages)
        # (Python's other spellings of the same values: a pathlib.Path, a tuple of names)
        if output_dir is not None and isinstance(output_dir, os.PathLike):
            output_dir = os.fspath(output_dir)
        if isinstance(activities, tuple):
            activities = list(activities)
        req = ProfileReq(ProfileReqType.START_PROFILE, output_dir, num_steps, activities, with_stack, record_shapes, profile_prefix)
        resolve_profile_args(req, self.server_args.device)  # (the scheduler checks again; here as a ValueError)
        out = self.scheduler.profile(req)
        if not out.success:
            raise RuntimeError(out.message.replace("/stop_profile", "stop_profile()"))
        return out.message

    @_locked
    def stop_profile(self) -> List[str]:
        """Stop the profiler started by start_profile() and write its files; returns their paths.
        RuntimeError when no profile runs (num_steps may have ended it: see
        `scheduler.last_profile_paths`) or the files could not be written."""
        self._check_open()
        out = self.scheduler.profile(ProfileReq(ProfileReqType.STOP_PROFILE))
        if not out.success:
            raise RuntimeError(out.message.replace("/start_profile", "start_profile()"))
        return out.paths

    @_locked
    def shutdown(self) -> None:
        """Abort everything in flight and drop the model, its KV pool and the scheduler holding them.

        An Engine is single-use after this: every other call raises RuntimeError.
        """
        if self._closed:
            return
        try:
            if not self._broken and not self.scheduler.is_idle():
                self._guarded(self._handover, [AbortReq(abort_all=True)], False, self._abort_locally)
                # until the scheduler holds nothing (not until every state finished: one it never
                # received would keep this waiting for ever); running requests end at their next forward
                for _ in range(1000):
                    if self.scheduler.is_idle():
                        break
                    self.step(snapshot=False)
                else:
                    logger.warning("shutdown: the scheduler still held requests after aborting all of them")
        except RankDiedError as e:  # (a rank is gone: nothing to step with; the rest is cleared below)
            logger.warning("shutdown: %s", e)
        finally:
            if self._tp is not None:  # the other ranks leave their loop and are joined
                self._tp.close()
        self.rid_to_state.clear()
        self._samples_of.clear()
        self.scheduler.shutdown_grammar_backend()  # (its threads and compiled grammars)
        if self.scheduler.profile_in_progress:  # (torch.profiler is the process's: it must not record on)
            out = self.scheduler.profile(ProfileReq(ProfileReqType.STOP_PROFILE))
            logger.warning("shutdown: profiling was still on; %s", out.message)
        self._closed = True
        # the scheduler references the ModelRunner too: both go, so the memory is freed
        on_cuda = self.server_args.device == "cuda"
        self.scheduler = self.model_runner = self.detokenizer = None  # type: ignore[assignment]
        if on_cuda:  # out of torch's caching allocator too, so the next Engine (or process) sees it free
            import torch

            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was shut down; create a new Engine(...)")
        if self._broken:
            raise RuntimeError(
                f"this Engine stopped in the middle of a scheduler step ({self._broken}), so its requests "
                "and KV cache no longer add up; shutdown() it and create a new Engine(...)"
            )

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@contextlib.contextmanager
def _no_turn() -> Iterator[bool]:
    """The heartbeat's turn once its Engine is gone (its finalizer stops the heartbeat)."""
    yield False


@contextlib.contextmanager
def _signals_held_until_the_end() -> Iterator[None]:
    """Hold every signal with a Python handler (Ctrl-C's SIGINT, a SIGALRM timeout, ...) while the
    block runs, then deliver each to its handler.

    An exception raised by a handler inside a forward would leave a batch half-built: its
    requests out of the waiting queue but in no batch, KV allocated but not recorded, where no
    abort can reach them. Held to the end of the step, it lands on a whole scheduler, and
    generate() can abort what it started. Only the main thread can set signal handlers (a
    Jupyter kernel runs cells there); elsewhere nothing is held. A nested block holds nothing more.
    """
    global _signals_held
    if threading.current_thread() is not threading.main_thread() or _signals_held:
        yield
        return
    held = {}
    for sig in _CATCHABLE_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler) and getattr(handler, "__name__", "") != "_sighandler_noop":
            # (asyncio's add_signal_handler installs that no-op and reads the signal from its wakeup
            # fd, written already when it arrived: raising it again would run the callback twice)
            held[sig] = handler
        elif handler is None and sig == signal.SIGINT:  # set outside Python: cannot be put back, Python's own instead
            held[sig] = signal.default_int_handler
    arrived: List[int] = []
    for sig in held:
        signal.signal(sig, lambda signum, frame: arrived.append(signum))
    _signals_held = True
    try:
        yield
    finally:
        _signals_held = False
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(arrived):  # each once, in the order they came
            signal.raise_signal(sig)  # to the restored handler: KeyboardInterrupt for SIGINT by default


# The named signals (not the real-time ones, which Python code hardly ever handles: scanning all
# of them at every step cost more than the rest of the Engine's own work on a tiny model), as
# ints (getsignal is slower on enum members); SIGKILL and SIGSTOP cannot be caught. Only the
# main thread reads or sets _signals_held.
_CATCHABLE_SIGNALS = tuple(int(sig) for sig in signal.Signals if sig not in (signal.SIGKILL, signal.SIGSTOP))
_signals_held = False


def _check_prompt(prompt: Prompt, input_ids: InputIds) -> bool:
    """The shape of a prompt argument, with a message per mistake (the server's pydantic model
    checks these types). Returns whether it is a single prompt."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("Exactly one of `prompt` and `input_ids` must be given")
    if prompt is not None:
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
            raise ValueError(f"`prompt` must be a string or a non-empty list of strings, got {_describe(prompt)}")
        return isinstance(prompt, str)
    if not isinstance(input_ids, list):
        raise ValueError(f"`input_ids` must be a list of ints or a list of such lists, got {_describe(input_ids)}")
    if input_ids and isinstance(input_ids[0], list) and not all(isinstance(ids, list) for ids in input_ids):
        raise ValueError("`input_ids` mixes lists and ints: pass one list of ints, or a list of such lists")
    return not (input_ids and isinstance(input_ids[0], list))


def _check_update_args(load_format: Any, abort_all_requests: Any, weight_version: Any) -> None:
    """A weight update's common arguments (the scheduler refuses a load_format it cannot read)."""
    if load_format is not None and not isinstance(load_format, str):
        raise ValueError(f"load_format must be a str or None, got {_describe(load_format)}")
    if not isinstance(abort_all_requests, bool):
        raise ValueError(f"abort_all_requests must be True or False, got {_describe(abort_all_requests)}")
    if weight_version is not None and not isinstance(weight_version, str):
        raise ValueError(f"weight_version must be a str or None, got {_describe(weight_version)}")


def _describe(value: Any) -> str:
    """A short description of a wrong argument for an error message."""
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {'/'.join(kinds)}" if value else "an empty list"
    return type(value).__name__


def _processor_str(value: Any) -> Any:
    """An Engine call's custom_logit_processor as the server takes it: a CustomLogitProcessor
    subclass becomes its to_str() (for notebooks: pass the class); a string, None, or anything
    else (refused by check_custom_logit_processor) as it is; a list element by element."""
    if isinstance(value, list):
        return [_processor_str(v) for v in value]
    from minisgl.sampling.custom_logit_processor import CustomLogitProcessor

    if isinstance(value, CustomLogitProcessor):
        raise ValueError(
            f"custom_logit_processor takes the class ({type(value).__name__}), not an instance: the scheduler "
            "makes its own instance with no arguments, as SGLang's does"
        )
    if isinstance(value, type) and issubclass(value, CustomLogitProcessor):
        return value.to_str()
    return value


def _refused_raises(outputs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """generate()'s outputs as they are, unless the scheduler refused one with a 400 (a grammar
    that does not compile, a prompt past its gate, a custom logit processor that failed): then the ValueError the server's 400 is,
    as SGLang's Engine raises it (for a batch, the first; the others were released or finished): a
    ParamError naming the field when the abort names one (a grammar's key), as verify's errors do."""
    for out in outputs:
        reason = out["meta_info"]["finish_reason"]
        if isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("status_code") == 400:
            message = reason.get("message") or "Bad request"
            raise ParamError(message, reason["param"]) if reason.get("param") else ValueError(message)
    return outputs
