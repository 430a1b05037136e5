"""TokenizerManager (stage 2, seed 000 + seed 004). In: GenerateReqInput. Out: response dicts.

Where it sits: inside the HTTP process, on uvicorn's asyncio loop. The OpenAI serving
layer hands it a `GenerateReqInput`; it registers a `ReqState` in `rid_to_state`,
tokenizes, sends `TokenizedGenerateReqInput` to the Scheduler (ZMQ PUSH), and
`handle_loop` fills each ReqState from the `BatchStrOutput`s the Detokenizer sends back
(ZMQ PULL on tokenizer_ipc_name). `_wait_one_response` turns a ReqState into the
stream of dicts the serving layer renders:

    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "output_token_logprobs": [(logprob, id, text)],
     "output_top_logprobs": [[(logprob, id, text), ...]], "input_token_logprobs": [(logprob | None,
     id, text)], "input_top_logprobs": [None | [(logprob, id, text), ...]],
     "output_token_ids_logprobs" / "input_token_ids_logprobs": the same per position for the
     ids of token_ids_logprob, "hidden_states"? (only when asked: return_hidden_states; float32
     numpy arrays, entry 0 [n, H] then [H] each, which the serving layer writes as JSON), "e2e_latency"?}}
    (+ "index" for batches; text is None unless return_text_in_logprobs, as SGLang's)

An embedding request (EmbeddingReqInput, a server started with --is-embedding) takes the same
path with TokenizedEmbeddingReqInput and comes back as one BatchEmbeddingOutput, rendered as
    {"embedding": [float], "meta_info": {"id", "finish_reason", "prompt_tokens", "cached_tokens", "e2e_latency"}}
Each kind of server refuses the other kind of request with a ValueError (a 400).

Streaming dicts carry deltas (SGLang's incremental streaming); the final dict of a
non-streaming request carries the whole text, ids, logprobs and hidden states. Prompt logprobs
(asked for by `logprob_start_len`) come once, in the first dict after the prompt was prefilled;
so does the prompt's entry of the hidden states (Req.hidden_states' layout).
Owns: rid_to_state, the request-side Prometheus metrics, the dynamic batch tokenizer, the
LoRARegistry (the adapters a request may name; /load_lora_adapter and /unload_lora_adapter) and
LoRAInFlight (each adapter load's requests in flight, what an unload waits for).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import zmq
import zmq.asyncio

from minisgl.aio_rwlock import RWLock
from minisgl.managers import tokenization
from minisgl.managers.io_struct import (
    LOGPROB_META_KEYS,
    MAX_SUB_REQUESTS,
    MAX_TOKEN_IDS_LOGPROB,
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    EmbeddingReqInput,
    FlushCacheReqInput,
    FreezeGCReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ProfileReq,
    ProfileReqOutput,
    ProfileReqType,
    Sample,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    check_logprob_args,
    decode,
    encode,
    expand_samples,
    hidden_states_of,
    logprobs_of,
    new_rid,
    prefix_warmups,
    spec_meta_info,
)
from minisgl.lora.lora_registry import LORA_NOT_ENABLED, LoRAInFlight, LoRARegistry, check_lora_load_args
from minisgl.managers.tokenizer_manager_score_mixin import TokenizerManagerScoreMixin
from minisgl.sampling.sampling_params import MAX_TOP_LOGPROBS_NUM, SamplingParams
from minisgl.server_args import PortArgs, ServerArgs
from minisgl.utils import ParamError, freeze_gc, get_zmq_socket

logger = logging.getLogger("minisgl.tokenizer_manager")

# SGLANG_REQUEST_STATE_WAIT_TIMEOUT: how often a waiting request checks for a gone client.
REQUEST_STATE_WAIT_TIMEOUT = float(os.environ.get("MINISGL_REQUEST_STATE_WAIT_TIMEOUT", "4"))
# --log-requests: how much of a prompt or an answer one log line shows (SGLang's partial logging)
LOG_REQUEST_CHARS = 2048
# The server's caps on one request's size (the in-process Engine, one user's, has none);
# MAX_SUB_REQUESTS and MAX_TOKEN_IDS_LOGPROB live in io_struct.py (the score mixin reads them too).
MAX_STOP_STRINGS = 64  # OpenAI takes 4
# stop_regex: searched at every step too, and compiled on the event loop (a 200k-character
# pattern took 0.9 s, once here and once in the scheduler)
MAX_STOP_REGEXES = 64
MAX_STOP_REGEX_CHARS = 4096  # all of one prompt's patterns together
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_IDS = 1024  # read into a tensor row at every step of the request's batch
MAX_RID_CHARS = 256  # a rid rides in every step's output message and snapshot: 4 MB ones cost GBs
# Requests with more text than this (prompt and stop strings, in characters) are tokenized in
# a worker thread: ~1 ms per 2,000 characters, so this is where one starts to stall others.
TOKENIZE_OFF_LOOP_CHARS = 20_000
# a load's or an unload's message (TokenizerManager._update_lora runs either)
_LoRAUpdateReq = TypeVar("_LoRAUpdateReq", LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)
# SGLang's HEALTH_CHECK_TIMEOUT: how long /health_generate waits for the pipeline to answer.
HEALTH_CHECK_TIMEOUT = 20.0
# A backlog this long means the client reads slower than the engine writes (seed 004).
STREAMING_BACKLOG_WARN = 20
# A request of the kind the server does not run: a 400 saying which server it needs (the embedding
# one is SGLang's message; SGLang has none for the other way round)
EMBEDDING_ON_GENERATION_SERVER = (
    "This model does not appear to be an embedding model by default. Please add `--is-embedding` when launching "
    "the server or try another model."
)
GENERATION_ON_EMBEDDING_SERVER = (
    "This is an embedding server (started with --is-embedding): it computes embeddings (/v1/embeddings, /encode), "
    "not text. /generate, /v1/completions and /v1/chat/completions need a server started without --is-embedding."
)


class ReqAbortedError(Exception):
    """A request finished with an abort that carries an HTTP status (e.g. 503 queue full)."""

    def __init__(self, message: str, status_code: int, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param  # (the field it is about, /generate's name, when the scheduler said: FINISH_ABORT.param)


@dataclass
class ReqState:
    """Everything the HTTP side knows about one in-flight rid (SGLang's ReqState)."""

    obj: Union[GenerateReqInput, EmbeddingReqInput]
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out_list: List[Dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    sent: bool = False  # TokenizedGenerateReqInput left for the scheduler
    abort_requested: bool = False  # aborted before it was sent (while tokenizing): never send it
    abort_sent: bool = False  # an AbortReq left for it (SGLang 0.5.23's): one per request
    abandoned: bool = False  # nobody reads it any more: aborted, waiting for the scheduler's finish
    # time stats (perf_counter seconds)
    created_time: float = field(default_factory=time.perf_counter)
    tokenize_finish_time: float = 0.0
    first_token_time: float = 0.0
    last_time: float = 0.0
    last_completion_tokens: int = 0
    finished_time: float = 0.0
    # accumulated output
    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    logprobs: Dict[str, List[Any]] = field(default_factory=lambda: {key: [] for key in LOGPROB_META_KEYS})
    hidden_states: List[Any] = field(default_factory=list)  # every entry so far (return_hidden_states): float32 arrays
    prompt_tokens: int = 0


class TokenizerMetricsCollector:
    """Request-side Prometheus metrics with SGLang's names (sglang-facts.md §9.2).

    Each collector owns its registry, so several servers (or tests) in one process
    never collide on the global prometheus registry.
    """

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}
        r = self.registry
        self.prompt_tokens_total = Counter("sglang:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens_total = Counter("sglang:generation_tokens", "Generation tokens produced.", labels, registry=r)
        self.cached_tokens_total = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.", labels, registry=r)
        self.num_requests_total = Counter("sglang:num_requests", "Requests finished.", labels, registry=r)
        self.num_aborted_requests_total = Counter("sglang:num_aborted_requests", "Requests aborted.", labels, registry=r)
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token.", labels, registry=r,
            buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400],
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds", "Time between output tokens.", labels, registry=r,
            buckets=[0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
                     0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0],
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency.", labels, registry=r,
            buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800, 1200, 2400],
        )  # fmt: skip
        # Scheduler-side gauges: refreshed from GetLoadReqOutput on every /metrics scrape.
        self.num_running_reqs = Gauge("sglang:num_running_reqs", "Requests in the running batch.", labels, registry=r)
        self.num_queue_reqs = Gauge("sglang:num_queue_reqs", "Requests in the waiting queue.", labels, registry=r)
        self.num_used_tokens = Gauge("sglang:num_used_tokens", "KV slots held by requests.", labels, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "Fraction of the KV pool in use.", labels, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "Prefix cache hit rate.", labels, registry=r)
        self.max_total_num_tokens = Gauge("sglang:max_total_num_tokens", "KV pool size in tokens.", labels, registry=r)
        self.gen_throughput = Gauge("sglang:gen_throughput", "Output tokens/s at the last decode log line (0 when idle).", labels, registry=r)

    def observe_load(self, load: GetLoadReqOutput) -> None:
        self.num_running_reqs.labels(**self.labels).set(load.num_running_reqs)
        self.num_queue_reqs.labels(**self.labels).set(load.num_waiting_reqs)
        self.num_used_tokens.labels(**self.labels).set(load.num_used_tokens)
        self.token_usage.labels(**self.labels).set(load.token_usage)
        self.cache_hit_rate.labels(**self.labels).set(load.cache_hit_rate)
        self.max_total_num_tokens.labels(**self.labels).set(load.max_total_num_tokens)
        self.gen_throughput.labels(**self.labels).set(load.gen_throughput)

    def observe_output(self, state: ReqState, completion_tokens: int, now: float, first_token_time: Optional[float] = None) -> None:
        """TTFT once on the first output (at `first_token_time` when the output came later than the
        token: a non-streaming request's); ITL as interval / new tokens, counted per token."""
        if state.first_token_time == 0.0:
            state.first_token_time = first_token_time or now
            self.time_to_first_token.labels(**self.labels).observe(state.first_token_time - state.created_time)
        else:
            new_tokens = completion_tokens - state.last_completion_tokens
            if new_tokens > 0:
                interval = (now - state.last_time) / new_tokens
                for _ in range(new_tokens):
                    self.inter_token_latency.labels(**self.labels).observe(interval)
        state.last_time = now
        state.last_completion_tokens = completion_tokens

    def observe_finished(self, state: ReqState, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens_total.labels(**self.labels).inc(prompt_tokens)
        self.generation_tokens_total.labels(**self.labels).inc(completion_tokens)
        self.cached_tokens_total.labels(**self.labels).inc(cached_tokens)
        self.num_requests_total.labels(**self.labels).inc()
        self.e2e_request_latency.labels(**self.labels).observe(state.finished_time - state.created_time)


class AsyncDynamicBatchTokenizer:
    """Tokenize concurrent single texts in one batched call (`--enable-dynamic-batch-tokenizer`).

    Texts submitted while a batch is being tokenized (or within `batch_wait_timeout_s`
    of the first one) are tokenized together by the next call; the tokenizer runs in
    one worker thread so the event loop keeps accepting requests meanwhile.
    """

    def __init__(self, tokenizer: Any, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.002) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.pending: List[Tuple[str, bool, asyncio.Future]] = []  # text, add_special_tokens, its ids
        # the sizes of the last batched tokenizer calls (what tests read); bounded: a server runs for days
        self.batch_sizes: Deque[int] = collections.deque(maxlen=1024)
        self._worker: Optional[asyncio.Task] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dyn-tokenizer")

    async def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        tokenization.check_text(text)  # bad text fails here, alone, before it joins anyone's batch
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((text, add_special_tokens, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())
        return await fut

    async def _run(self) -> None:
        await asyncio.sleep(self.batch_wait_timeout_s)  # let concurrent arrivals join the batch
        loop = asyncio.get_running_loop()
        while self.pending:
            # one call per add_special_tokens value (chat prompts take none, completions the BOS)
            special = self.pending[0][1]
            batch: List[Tuple[str, bool, asyncio.Future]] = []
            rest: List[Tuple[str, bool, asyncio.Future]] = []
            for item in self.pending:  # (one pass: a burst of thousands waits here, on the event loop)
                (batch if item[1] == special and len(batch) < self.max_batch_size else rest).append(item)
            self.pending = rest
            texts = [text for text, _, _ in batch]
            self.batch_sizes.append(len(texts))
            try:
                ids = await loop.run_in_executor(self._executor, tokenization.encode_texts, self.tokenizer, texts, special)
            except Exception:
                # the batched call failed: tokenize one by one, so that only the text at
                # fault fails and the requests that shared its batch go on
                for text, _, fut in batch:
                    try:
                        row = await loop.run_in_executor(self._executor, tokenization.encode_text, self.tokenizer, text, special)
                    except Exception as e:
                        if not fut.done():
                            fut.set_exception(e)
                    else:
                        if not fut.done():
                            fut.set_result(list(row))
                continue
            for (_, _, fut), row in zip(batch, ids):
                if not fut.done():
                    fut.set_result(list(row))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class TokenizerManager(TokenizerManagerScoreMixin):
    """The HTTP process's end of the pipeline: GenerateReqInput in, response dicts out (and
    `score_request`, /v1/score's: the mixin, tokenizer_manager_score_mixin.py)."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        tokenizer: Any,
        context_len: int,
        vocab_size: int,
        max_req_input_len: Optional[int] = None,
        default_sampling_params: Optional[Dict[str, Any]] = None,
        hidden_size: Optional[int] = None,
        is_matryoshka: bool = False,
        matryoshka_dimensions: Optional[Sequence[int]] = None,
    ) -> None:
        self.server_args = server_args
        # --is-embedding: embedding requests only; the model's Matryoshka sizes check their `dimensions`
        self.is_embedding = server_args.is_embedding
        # the adapters a request may name (--lora-paths, then /load_lora_adapter); None: LoRA off.
        # Loads and unloads take turns (lora_update_lock): each sees the registry the last one left
        self.lora_registry = LoRARegistry(server_args.lora_adapters or ()) if server_args.enable_lora else None
        self.lora_update_lock = asyncio.Lock()
        self.lora_in_flight = LoRAInFlight()  # requests per lora_id, from registration to deletion (_drop_state)
        self.hidden_size = hidden_size
        self.is_matryoshka = is_matryoshka
        self.matryoshka_dimensions = matryoshka_dimensions
        # the model's generation_config sampling keys, which chat requests fall back to
        self.default_sampling_params: Dict[str, Any] = dict(default_sampling_params or {})
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.max_req_input_len = max_req_input_len  # the scheduler's prompt limit (None: the context)
        self.vocab_size = vocab_size
        self.model_name = server_args.served_model_name or server_args.model_path or "minisgl"
        # SGLang's model_update_lock: requests hold its reader side while in flight, a weight update its
        # writer side (aio_rwlock.py); the served weights' source and name, which an update moves on
        self.model_update_lock = RWLock()
        self.model_path = server_args.model_path
        self.weight_version = server_args.weight_version
        self.rid_to_state: Dict[str, ReqState] = {}
        # n > 1: the client's rid -> {sample rid: that sample's request}; the request object tells a
        # sample still in flight from another client's later request that reuses a finished one's rid
        self.samples_of: Dict[str, Dict[str, GenerateReqInput]] = {}
        self.metrics = TokenizerMetricsCollector(self.model_name)
        self.dynamic_batch_tokenizer = (
            AsyncDynamicBatchTokenizer(tokenizer) if server_args.enable_dynamic_batch_tokenizer else None
        )
        self.wait_timeout = REQUEST_STATE_WAIT_TIMEOUT
        # A prompt has at least len(text) / (the longest vocabulary entry) tokens: past twice
        # that many characters per context token it cannot fit, and is refused before the
        # tokenizer builds millions of tokens (a 10 MB prompt cost the HTTP process 1.7 GB, kept).
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # noqa: BLE001 - a tokenizer that cannot list its vocabulary: no bound
            vocab = {}
        self.longest_token_chars = max((len(t) for t in vocab), default=0)
        self.max_prompt_chars = 2 * context_len * self.longest_token_chars if vocab else float("inf")
        self.context = zmq.asyncio.Context()
        self.recv_from_detokenizer = get_zmq_socket(self.context, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
        self.send_to_scheduler = get_zmq_socket(self.context, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False)
        # One control request of each kind in flight at a time; handle_loop resolves it.
        self._control_locks: Dict[type, asyncio.Lock] = {}
        self._control_futures: Dict[type, Tuple[int, asyncio.Future]] = {}  # (its number, its future)
        # Per reply type: [requests sent, replies received]. The scheduler answers every control
        # request once, in order, so reply k answers request k: a reply whose caller timed out
        # is dropped when it comes, never handed to the next caller (who would read the
        # previous step's load or flush result, and every later caller one behind).
        self._control_counts: Dict[type, List[int]] = {}
        self.last_receive_tstamp = time.time()
        self._health_checks: Set[asyncio.Task] = set()  # /health_generate probes still running

    # ------------------------------------------------------------------ generate
    async def generate_request(
        self, obj: Union[GenerateReqInput, EmbeddingReqInput], request: Any = None
    ) -> AsyncIterator[Dict[str, Any]]:
        """Seed 000's order: normalize, rid and field checks, priority, state, tokenize, send, wait.
        An EmbeddingReqInput takes the same steps (_embedding_request)."""
        if isinstance(obj, EmbeddingReqInput):
            async for out in self._embedding_request(obj, request):
                yield out
            return
        if self.is_embedding:
            raise ValueError(GENERATION_ON_EMBEDDING_SERVER)
        obj.normalize_batch_and_arguments()
        params = self._validate_request_shape(obj)
        # (a request without one gets the scheduler's default: the least important, SGLang's)
        tokenization.check_priority(obj.priority, self.server_args.enable_priority_scheduling)
        tokenization.check_custom_logit_processor(obj, self.server_args.enable_custom_logit_processor)
        tokenization.check_return_hidden_states(obj, self.server_args.enable_return_hidden_states)
        tokenization.check_extra_key(obj)
        n = params[0].n if obj.is_single else 1
        # SGLang's order: the reader lock (a weight update waits for it, and it for one), then the
        # adapters. No await from the resolution to the ReqStates' registration (_init_req_state,
        # first thing in both paths): an unload finds each request that resolved its adapter among
        # those it waits for, or the request finds the name gone. (Resolved before the lock, a
        # request could wait behind an update holding an id that an unload meanwhile freed.)
        async with self.model_update_lock.reader_lock():
            tokenization.resolve_lora_ids(obj, self.lora_registry)
            if obj.is_single and n == 1:
                async for out in self._generate_one(obj, request):
                    yield out
            else:
                async for out in self._handle_batch_request(obj, request):
                    yield out

    async def _embedding_request(self, obj: EmbeddingReqInput, request: Any) -> AsyncIterator[Dict[str, Any]]:
        """An embedding request: its checks, then the generation path (a batch fans out into
        one rid per prompt, each tokenized and checked before any is sent)."""
        if not self.is_embedding:
            raise ValueError(EMBEDDING_ON_GENERATION_SERVER)
        obj.normalize_batch_and_arguments()
        obj.check_rids(MAX_RID_CHARS)
        if obj.batch_size > MAX_SUB_REQUESTS:
            raise ValueError(f"This request has {obj.batch_size} inputs; at most {MAX_SUB_REQUESTS} per request: split it")
        tokenization.check_dimensions(
            obj.dimensions, self.is_matryoshka, self.matryoshka_dimensions, self.hidden_size or 0, self.model_name
        )
        async with self.model_update_lock.reader_lock():
            outs = self._generate_one(obj, request) if obj.is_single else self._handle_batch_request(obj, request)
            async for out in outs:
                yield out

    @staticmethod
    def _validate_request_shape(obj: GenerateReqInput) -> List[SamplingParams]:
        """Whole-request checks, before any rid is registered or sent: a bad field fails the
        request as a whole, so no sibling of a batch reaches the scheduler first. Returns the
        checked SamplingParams, one per prompt."""
        obj.check_rids(MAX_RID_CHARS)
        param_dicts = [obj.sampling_params] if obj.is_single else obj.sampling_params
        TokenizerManager._check_stop_regex_size(param_dicts)  # (before verify, which compiles them)
        params = [SamplingParams.from_dict(d) for d in param_dicts]  # unknown keys and wrong types
        for p in params:
            p.verify()  # ranges, n >= 1 among them
        TokenizerManager._check_request_size(obj, param_dicts)
        for single in obj.singles():  # (the logprob fields may be one per prompt)
            check_logprob_args(
                single.return_logprob, single.logprob_start_len, single.top_logprobs_num, single.return_text_in_logprobs,
                single.token_ids_logprob,
            )  # fmt: skip
            ids = single.token_ids_logprob
            if ids and len(ids) > MAX_TOKEN_IDS_LOGPROB:
                # every position reports each id: a whole-vocabulary list is top_logprobs_num's problem again
                raise ValueError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} ids, got {len(ids)}")
            if single.top_logprobs_num > MAX_TOP_LOGPROBS_NUM:  # type: ignore[operator]
                # OpenAI's bound (top_logprobs <= 20) on /generate too: a top-k over the whole vocabulary
                # per token made one answer hundreds of MB, and its encoding stalled every other stream.
                # (The in-process Engine, one user's, takes any k.)
                raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {single.top_logprobs_num}")
        return params

    @staticmethod
    def _check_request_size(obj: GenerateReqInput, param_dicts: List[Any]) -> None:
        """Bounds on what one HTTP request may ask of a server others share (SGLang has none):
        each was measured to stall every other client for seconds, or to keep GBs."""
        sub_requests = sum(int(d.get("n", 1)) if isinstance(d, dict) and isinstance(d.get("n", 1), int) else 1
                           for d in (param_dicts or [None]))  # fmt: skip
        if sub_requests > MAX_SUB_REQUESTS:  # prompts x n: 1000 x 128 stalled /health for 17 s
            raise ValueError(
                f"This request fans out into {sub_requests} generations (prompts x n); at most "
                f"{MAX_SUB_REQUESTS} per request: split it"
            )
        for d in param_dicts or []:
            if not isinstance(d, dict):
                continue
            stop, stop_ids = d.get("stop"), d.get("stop_token_ids")
            if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:  # checked at every step: 100k slowed all others 40x
                raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
            if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
            bias = d.get("logit_bias")
            if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS_IDS:
                raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(bias)}")

    @staticmethod
    def _check_stop_regex_size(param_dicts: List[Any]) -> None:
        """The server's bounds on stop_regex: every step searches each pattern, and verify compiles
        them on this event loop."""
        for d in param_dicts or []:
            patterns = d.get("stop_regex") if isinstance(d, dict) else None
            patterns = [patterns] if isinstance(patterns, str) else patterns if isinstance(patterns, list) else []
            if len(patterns) > MAX_STOP_REGEXES:
                raise ValueError(f"stop_regex takes at most {MAX_STOP_REGEXES} patterns, got {len(patterns)}")
            chars = sum(len(p) for p in patterns if isinstance(p, str))
            if chars > MAX_STOP_REGEX_CHARS:
                raise ValueError(f"stop_regex patterns take at most {MAX_STOP_REGEX_CHARS} characters in all, got {chars}")

    async def _generate_one(
        self,
        obj: Union[GenerateReqInput, EmbeddingReqInput],
        request: Any,
        state: Optional[ReqState] = None,
        tokenized: Optional[Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput]] = None,
    ) -> AsyncIterator[Dict[str, Any]]:
        """One rid: register, tokenize, send, wait (a batch registered and tokenized it already)."""
        state = state or self._init_req_state(obj)
        try:
            if tokenized is None:
                tokenized = await self._tokenize_one_request(obj)
            state.tokenize_finish_time = time.perf_counter()
            state.prompt_tokens = len(tokenized.input_ids)
            if state.finished:
                pass  # ended here while it was tokenized (fail_all_requests): nothing to send
            elif state.abort_requested:  # aborted while it was tokenized: the scheduler never sees it
                self._finish_locally([obj.rid], {"type": "abort", "message": "Abort before the request was scheduled"})
            else:
                self._send_one_request(tokenized, state)
            async for out in self._wait_one_response(obj, state, request):
                yield out
        finally:
            # Error, or the consumer went away (client disconnect cancels the stream): free
            # the scheduler's memory now. A request the scheduler holds keeps its rid
            # registered, abandoned, until its abort comes back (_handle_batch_output): until
            # then the rid is still in flight, and a new request reusing it would be handed
            # the old one's outputs (SGLang keeps the state the same way).
            if not state.finished and self.rid_to_state.get(obj.rid) is state:
                if state.sent:
                    state.abandoned = True
                    self.abort_request(obj.rid, with_samples=False)  # this rid only, never another's samples
                else:
                    self._drop_state(obj.rid)

    def _init_req_state(self, obj: GenerateReqInput) -> ReqState:
        rid = obj.rid
        assert isinstance(rid, str)
        if rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: rid={rid} is already in flight")
        state = ReqState(obj=obj)
        if self.server_args.log_requests:
            logger.info(
                "Receive: rid=%s text=%s input_ids=%s sampling_params=%s",
                rid, _clip(obj.text), _clip(obj.input_ids), obj.sampling_params,
            )  # fmt: skip
        else:
            logger.debug("Receive: rid=%s", rid)
        self.rid_to_state[rid] = state  # registered BEFORE tokenizing (0.5.23 order)
        lora_id = getattr(obj, "lora_id", None)
        if lora_id is not None:  # (an unload of that load waits for it: LoRAInFlight)
            self.lora_in_flight.acquire(lora_id)
        return state

    def _drop_state(self, rid: str) -> None:
        """Forget a rid's ReqState: every deletion goes through here, so the count of its adapter's
        requests in flight (what an unload waits for) falls with it."""
        state = self.rid_to_state.pop(rid)
        lora_id = getattr(state.obj, "lora_id", None)
        if lora_id is not None:
            self.lora_in_flight.release(lora_id)

    async def _tokenize_one_request(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        if isinstance(obj.text, str) and len(obj.text) > self.max_prompt_chars:
            if not self.server_args.allow_auto_truncate:
                raise ParamError(
                    f"The input ({len(obj.text)} characters, so at least {len(obj.text) // self.longest_token_chars} "
                    f"tokens) is longer than the model's context length ({self.context_len} tokens).",
                    "text",
                )
            obj.text = obj.text[: self.max_prompt_chars]  # still past the context: the gate truncates it
        if obj.input_ids is None and self.dynamic_batch_tokenizer is not None:
            input_ids = await self._tokenize_texts(obj.text, obj.add_special_tokens)
            tokenized = self._create_tokenized_object(obj, obj.text, input_ids)
        elif _text_chars(obj) > TOKENIZE_OFF_LOOP_CHARS:
            # A big prompt (or stop list) takes seconds to tokenize, and on this event loop every
            # other client's stream would stop meanwhile: a worker thread does it (the Rust
            # tokenizer releases the GIL), and the loop goes on serving.
            tokenized = await asyncio.get_running_loop().run_in_executor(
                None, tokenization.tokenize_one_request, self.tokenizer, obj, self.vocab_size
            )
        else:
            tokenized = tokenization.tokenize_one_request(self.tokenizer, obj, self.vocab_size)
        self._validate_one_request(tokenized)
        return tokenized

    async def _tokenize_texts(self, text: str, add_special_tokens: bool = True) -> List[int]:
        assert self.dynamic_batch_tokenizer is not None
        return await self.dynamic_batch_tokenizer.encode(text, add_special_tokens)

    def _create_tokenized_object(self, obj: GenerateReqInput, text: Optional[str], ids: List[int]) -> TokenizedGenerateReqInput:
        return tokenization.create_tokenized_object(obj, text, ids, self.tokenizer, self.vocab_size)

    def _validate_one_request(self, tokenized: TokenizedGenerateReqInput) -> None:
        """SGLang's context-length gate (shared with the Engine: tokenization.validate_context_length)."""
        tokenization.validate_context_length(
            tokenized, self.context_len, self.server_args.allow_auto_truncate, self.max_req_input_len
        )

    def _send_one_request(self, tokenized: TokenizedGenerateReqInput, state: ReqState) -> None:
        self._send_to_scheduler(tokenized)
        state.sent = True

    def _send_to_scheduler(self, msg: Any) -> None:
        if self.send_to_scheduler.closed:
            return  # shutting down (a late abort from a cancelled stream): nobody listens any more
        self.send_to_scheduler.send(encode(msg))

    async def _wait_one_response(self, obj: GenerateReqInput, state: ReqState, request: Any) -> AsyncIterator[Dict[str, Any]]:
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=self.wait_timeout)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    # (_generate_one's finally aborts this rid, once, and never another
                    # client's `<rid>-<j>` samples, which a plain abort_request(rid) would)
                    raise ValueError(f"Request is disconnected from the client side (type 1). Abort request rid={obj.rid}")
                continue
            # Drain atomically: no await between reading and clearing.
            out_list, state.out_list = state.out_list, []
            finished = state.finished
            state.event.clear()
            if len(out_list) >= STREAMING_BACKLOG_WARN:
                logger.warning(
                    "Streaming backlog: rid=%s, coalescing %d queued chunks into one. This may inflate P99 ITL.",
                    obj.rid, len(out_list),
                )  # fmt: skip
            out = coalesce_streaming_chunks(out_list)
            if finished:
                if not obj.stream:
                    out = self._full_output(state, out)
                if self.server_args.log_requests:  # the whole answer, before an abort becomes an error
                    logger.info(
                        "Finish: rid=%s finish_reason=%s out=%s",
                        obj.rid, out["meta_info"].get("finish_reason"), _clip(state.text),
                    )  # fmt: skip
                self._check_abort_status(out, obj.stream)
                yield out
                return
            if obj.stream:
                yield out
            elif request is not None and await request.is_disconnected():
                raise ValueError(f"Request is disconnected from the client side (type 3). Abort request rid={obj.rid}")

    @staticmethod
    def _full_output(state: ReqState, last: Dict[str, Any]) -> Dict[str, Any]:
        if isinstance(state.obj, EmbeddingReqInput):  # one message, whole; None if it ended without one (an abort)
            return {"embedding": last.get("embedding"), "meta_info": dict(last["meta_info"])}
        meta = dict(last["meta_info"])
        meta.update({key: list(entries) for key, entries in state.logprobs.items()})
        if "hidden_states" in meta:
            meta["hidden_states"] = list(state.hidden_states)
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    @staticmethod
    def _check_abort_status(out: Dict[str, Any], stream: bool) -> None:
        """An abort with an HTTP status becomes that error for a non-streaming request."""
        reason = out["meta_info"].get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("status_code"):
            if not stream:
                raise ReqAbortedError(reason.get("message") or "Aborted", int(reason["status_code"]), reason.get("param"))

    # ------------------------------------------------------------------ batches and n > 1
    async def _handle_batch_request(self, obj: GenerateReqInput, request: Any) -> AsyncIterator[Dict[str, Any]]:
        """Fan out into several rids and merge their outputs, each tagged with its "index"."""
        samples = expand_samples(obj)
        subs = [s.req for s in samples]
        # Every rid is registered first (a duplicate fails the batch; an abort that comes while the
        # batch is tokenized finds its rids), then every prompt is tokenized and checked before any
        # is sent: one bad prompt (an id out of the vocabulary, too long) fails the batch with
        # nothing of it prefilled, as a bad field does.
        states: List[ReqState] = []
        # the samples of an n > 1 request, by the rid its client chose: what /abort_request(<rid>) aborts
        parents = {s.req.rid: s.parent_rid for s in samples if s.req.rid != s.parent_rid}
        try:
            for sub in subs:
                states.append(self._init_req_state(sub))
                if sub.rid in parents:
                    self.samples_of.setdefault(parents[sub.rid], {})[sub.rid] = sub
            tokenized = await self._tokenize_batch(samples)
            await self._warm_prefixes(prefix_warmups(samples, tokenized), request)
        except BaseException:
            for sub, state in zip(subs, states):
                if self.rid_to_state.get(sub.rid) is state:
                    self._drop_state(sub.rid)
            self._forget_samples(parents, subs)
            raise
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, sub: GenerateReqInput) -> None:
            try:
                async for out in self._generate_one(sub, request, states[index], tokenized[index]):
                    queue.put_nowait((index, out))
            except Exception as e:  # surfaced to the consumer, which cancels the siblings
                queue.put_nowait((index, e))
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.get_running_loop().create_task(pump(i, sub)) for i, sub in enumerate(subs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    item["index"] = index
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # each sub-generator's finally aborts its rid if still running
            self._forget_samples(parents, subs)

    async def _warm_prefixes(self, warmups: List[TokenizedGenerateReqInput], request: Any) -> None:
        """Prefill each n > 1 prompt once and wait for it (io_struct.prefix_warmups): its samples then
        find the prompt in the radix tree. Kept out of the request metrics, as the health probe is."""

        async def warm(tokenized: TokenizedGenerateReqInput) -> None:
            # (its lora_id too: it runs with the samples' adapter, and an unload waits for it)
            obj = GenerateReqInput(
                input_ids=tokenized.input_ids, sampling_params={"max_new_tokens": 0}, rid=tokenized.rid, lora_id=tokenized.lora_id
            )
            obj.log_metrics = False
            obj.normalize_batch_and_arguments()
            async for _ in self._generate_one(obj, request, self._init_req_state(obj), tokenized):
                pass

        tasks = [asyncio.ensure_future(warm(w)) for w in warmups]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # one failed (a full queue's 503) or the client left: the others are aborted too
            # (each _generate_one's finally), not left to run for a request that is over
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _tokenize_batch(self, samples: List[Sample]) -> List[TokenizedGenerateReqInput]:
        """Each prompt tokenized and checked once, its n samples copies of it that differ in rid
        and seed only (as SGLang sends n copies): per sample, a long prompt was tokenized n times,
        and went on being tokenized in worker threads after the first copy's 400 had gone back."""
        subs = [s.req for s in samples]
        prompt_of = [s.prompt_index for s in samples]
        firsts = [k for k in range(len(subs)) if k == 0 or prompt_of[k] != prompt_of[k - 1]]
        bases = await asyncio.gather(*(self._tokenize_one_request(subs[k]) for k in firsts))
        base_of = {prompt_of[k]: base for k, base in zip(firsts, bases)}
        first_set = set(firsts)
        out: List[TokenizedGenerateReqInput] = []
        for k, sub in enumerate(subs):
            base = base_of[prompt_of[k]]
            if k in first_set:
                out.append(base)
                continue
            params = base.sampling_params.copy()
            params.seed = (sub.sampling_params or {}).get("seed")  # seed + j (expand_samples)
            out.append(dataclasses.replace(base, rid=sub.rid, sampling_params=params))
        return out

    def _forget_samples(self, parents: Dict[str, str], subs: List[GenerateReqInput]) -> None:
        """Drop this request's own sample entries: another request of the same parent rid may
        hold the same sample rids now (a later one that reuses a finished sample's rid)."""
        for sub in subs:
            parent = parents.get(sub.rid)
            samples = self.samples_of.get(parent) if parent is not None else None
            if samples is not None and samples.get(sub.rid) is sub:
                del samples[sub.rid]
                if not samples:
                    del self.samples_of[parent]

    # ------------------------------------------------------------------ abort and control
    def abort_request(self, rid: str = "", abort_all: bool = False, with_samples: bool = True) -> None:
        """Abort `rid`, and (`with_samples`) the samples `<rid>-<j>` of an n > 1 request `rid`, or all.

        The scheduler matches exact rids, so the samples go one message each."""
        if abort_all:
            targets = list(self.rid_to_state)
        else:
            targets = ([rid] if rid in self.rid_to_state else []) + (self._sample_rids(rid) if rid and with_samples else [])
        # one abort per request (SGLang 0.5.23's abort_sent): a rid already aborted (by its client's
        # disconnect or an earlier call, or marked while tokenized) is neither sent nor counted again
        targets = [t for t in targets if not (self.rid_to_state[t].abort_sent or self.rid_to_state[t].abort_requested)]
        if not targets:
            return
        # a request still being tokenized is not the scheduler's yet: an AbortReq would find
        # nothing there and be lost, and the request would run to the end once sent
        for target in targets:
            if not self.rid_to_state[target].sent:
                self.rid_to_state[target].abort_requested = True
        sent = [t for t in targets if self.rid_to_state[t].sent]
        for target in sent:
            self.rid_to_state[target].abort_sent = True
        counted = any(self.rid_to_state[t].obj.log_metrics for t in targets)  # (not a health probe's)
        if abort_all:
            self._send_to_scheduler(AbortReq(rid="", abort_all=True))
        else:
            for target in sent:
                self._send_to_scheduler(AbortReq(rid=target))
        if counted:
            self.metrics.num_aborted_requests_total.labels(**self.metrics.labels).inc()

    def _sample_rids(self, rid: str) -> List[str]:
        """The in-flight samples `<rid>-<j>` of this client's n > 1 request `rid` (recorded by
        _handle_batch_request): never another client's own rid that merely looks like one."""
        samples = self.samples_of.get(rid, {})
        return sorted(r for r, sub in samples.items() if r in self.rid_to_state and self.rid_to_state[r].obj is sub)

    def freeze_gc(self) -> None:
        """Freeze the GC here, then in the scheduler, which passes it on to the detokenizer."""
        freeze_gc("HTTP")
        self._send_to_scheduler(FreezeGCReq())

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control_request(FlushCacheReqInput(), FlushCacheReqOutput)

    async def get_load(self) -> GetLoadReqOutput:
        return await self._control_request(GetLoadReqInput(), GetLoadReqOutput)

    async def start_profile(self, req: ProfileReq) -> ProfileReqOutput:
        return await self._control_request(req, ProfileReqOutput, timeout=self.server_args.watchdog_timeout)

    async def stop_profile(self) -> ProfileReqOutput:
        # the scheduler writes the trace before it answers: a long profile takes a while (minutes),
        # with its watchdogs paused, so no timeout here either (a scheduler that dies ends the server)
        return await self._control_request(ProfileReq(ProfileReqType.STOP_PROFILE), ProfileReqOutput, timeout=None)

    # ------------------------------------------------------------------ LoRA adapters while serving
    async def load_lora_adapter(self, obj: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """SGLang's: mint the load's lora_id, let the scheduler read and check the adapter, and only
        then register the name (a failed load leaves nothing behind: LoRARegistry.loading).
        Refusals come back as the output's error_message (the route's 400)."""
        return await asyncio.shield(self._update_lora(self._load_lora_adapter_locked, obj))

    async def unload_lora_adapter(self, obj: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """SGLang's: unregister the name (new requests naming it are 400s from now on), wait until
        no request that resolved it is in flight, then let the scheduler drop the weights (it waits
        for its own requests of that load too). A failed unload leaves the name registered."""
        return await asyncio.shield(self._update_lora(self._unload_lora_adapter_locked, obj))

    async def _update_lora(self, update: Callable[[LoRARegistry, _LoRAUpdateReq], Awaitable[LoRAUpdateOutput]],
                           obj: _LoRAUpdateReq) -> LoRAUpdateOutput:  # fmt: skip
        """One load or unload at a time (lora_update_lock). Shielded by its callers: a client that
        leaves mid-way does not stop it half done (the scheduler holding weights no name reaches,
        or the reverse). A load's own fields are checked before it waits for its turn."""
        registry = self.lora_registry
        try:
            if registry is None:
                raise ValueError(LORA_NOT_ENABLED)
            if isinstance(obj, LoadLoRAAdapterReqInput):
                check_lora_load_args(obj.lora_name, obj.lora_path, obj.pinned)
            async with self.lora_update_lock:
                return await update(registry, obj)
        except ValueError as e:
            return LoRAUpdateOutput(False, str(e), registry.loaded_adapters() if registry is not None else {})

    async def _load_lora_adapter_locked(self, registry: LoRARegistry, obj: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        with registry.loading(obj.lora_name, obj.lora_path, obj.pinned, self.server_args.max_loaded_loras) as update:
            logger.info("Start load LoRA adapter. name=%s path=%s id=%s", obj.lora_name, obj.lora_path, update.msg.lora_id)
            # (no timeout: reading a big adapter takes what it takes; a scheduler that dies ends the server)
            update.out = await self._control_request(update.msg, LoRAUpdateOutput, timeout=None)
        return update.out

    async def _unload_lora_adapter_locked(self, registry: LoRARegistry, obj: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        with registry.unloading(obj.lora_name) as update:
            lora_id = update.msg.lora_id
            assert lora_id is not None
            logger.info("Start unload LoRA adapter. name=%s id=%s, %d request(s) in flight", obj.lora_name, lora_id,
                        self.lora_in_flight.count(lora_id))  # fmt: skip
            await self.lora_in_flight.wait_for_zero(lora_id)  # (SGLang's wait_for_unload)
            update.out = await self._control_request(update.msg, LoRAUpdateOutput, timeout=None)
        return update.out

    # ------------------------------------------------------------------ weights while serving
    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        """SGLang's: (abort_all_requests: abort every request first), wait for the requests in
        flight (model_update_lock's writer side; new ones wait behind it), let the scheduler load
        and flush, then record the new model_path and weight_version. Shielded, as LoRA updates:
        a client that leaves does not stop it half done (weights loaded, version not recorded)."""
        out = await asyncio.shield(self._update_weights(obj, UpdateWeightFromDiskReqOutput))
        if out.success:
            self.model_path = obj.model_path
        return out

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput) -> UpdateWeightsFromTensorReqOutput:
        """SGLang's, as update_weights_from_disk (the tensors: base64 safetensors, read by the scheduler)."""
        return await asyncio.shield(self._update_weights(obj, UpdateWeightsFromTensorReqOutput))

    async def _update_weights(self, obj: Any, reply_type: type) -> Any:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        async with self.model_update_lock.writer_lock():
            logger.info("Start update weights (%s)", type(obj).__name__)
            # (no timeout: reading a big checkpoint takes what it takes; a scheduler that dies ends the server)
            out = await self._control_request(obj, reply_type, timeout=None)
            if out.success and obj.weight_version is not None:
                self.weight_version = obj.weight_version
                out.message += f" Weight version updated to {obj.weight_version}."
        return out

    async def get_weights_by_name(self, obj: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        return await self._control_request(obj, GetWeightsByNameReqOutput, timeout=None)

    async def _control_request(self, msg: Any, reply_type: type, timeout: Optional[float] = 10.0) -> Any:
        lock = self._control_locks.setdefault(reply_type, asyncio.Lock())
        async with lock:
            fut = asyncio.get_running_loop().create_future()
            counts = self._control_counts.setdefault(reply_type, [0, 0])
            counts[0] += 1
            self._control_futures[reply_type] = (counts[0], fut)
            self._send_to_scheduler(msg)
            try:
                return await asyncio.wait_for(fut, timeout=timeout)
            finally:
                self._control_futures.pop(reply_type, None)

    # ------------------------------------------------------------------ receive loop
    async def handle_loop(self) -> None:
        """Receive BatchStrOutput and control replies forever; fill ReqStates."""
        while True:
            self._dispatch(decode(await self.recv_from_detokenizer.recv()))

    def _dispatch(self, recv: Any) -> None:
        """One message from the detokenizer (outputs) or the scheduler (control replies)."""
        if isinstance(recv, BatchStrOutput):
            # what /health_generate watches: only outputs come through the whole pipeline (a
            # control reply comes from the scheduler alone, and /metrics asks for one per scrape)
            self.last_receive_tstamp = time.time()
            self._handle_batch_output(recv)
        elif isinstance(recv, BatchEmbeddingOutput):
            self.last_receive_tstamp = time.time()
            self._handle_embedding_output(recv)
        elif type(recv) in self._control_counts:
            counts = self._control_counts[type(recv)]
            counts[1] += 1
            number, fut = self._control_futures.get(type(recv), (0, None))
            if fut is not None and number == counts[1] and not fut.done():
                fut.set_result(recv)
            # else: the late answer to a request whose caller timed out
        else:
            logger.warning("TokenizerManager received an unexpected %s", type(recv).__name__)

    def _live_states(self, recv: Union[BatchStrOutput, BatchEmbeddingOutput]) -> Iterator[Tuple[int, str, ReqState]]:
        """(index in the message, rid, its ReqState) for each output whose request is still known
        (one whose state is gone, e.g. its client left and its finish freed it, is skipped)."""
        for i, rid in enumerate(recv.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                logger.debug("Received output for rid=%s but the state was deleted", rid)
                continue
            yield i, rid, state

    def _handle_batch_output(self, recv: BatchStrOutput) -> None:
        now = time.perf_counter()
        for i, rid, state in self._live_states(recv):
            if state.abandoned:  # its reader is gone: only its finish matters (it frees the rid)
                if recv.finished_reasons[i] is not None:
                    self._drop_state(rid)
                    state.finished_time = now
                    if state.obj.log_metrics and recv.completion_tokens[i] > 0:  # it ran: a request served
                        self.metrics.observe_finished(state, recv.prompt_tokens[i], recv.completion_tokens[i], recv.cached_tokens[i])
                continue
            logprobs = logprobs_of(recv, i, self.tokenizer.batch_decode if state.obj.return_text_in_logprobs else None)
            state.text += recv.output_strs[i]
            state.output_ids.extend(recv.output_ids[i])
            for key, entries in logprobs.items():
                state.logprobs[key].extend(entries)
            finish_reason = recv.finished_reasons[i]
            meta_info: Dict[str, Any] = {
                "id": rid,
                "finish_reason": finish_reason,
                "prompt_tokens": recv.prompt_tokens[i],
                "weight_version": self.weight_version,
                "completion_tokens": recv.completion_tokens[i],
                "cached_tokens": recv.cached_tokens[i],
                **spec_meta_info(recv, i),
                **logprobs,
            }
            if getattr(state.obj, "return_hidden_states", False):  # (one that asked always has the key: [] when nothing is new)
                # float32 arrays, views of the received frame: the serving layer writes them as JSON
                # numbers off the event loop (entrypoints/hidden_states_json.py); nothing is decoded here
                rows = hidden_states_of(recv, i)
                hidden_states = rows.entries() if rows is not None else []
                state.hidden_states.extend(hidden_states)
                meta_info["hidden_states"] = hidden_states
            out = {"text": recv.output_strs[i], "output_ids": list(recv.output_ids[i]), "meta_info": meta_info}
            is_abort = isinstance(finish_reason, dict) and finish_reason.get("type") == "abort"
            if state.obj.log_metrics and not is_abort:  # (SGLang: TTFT from a non-abort output only)
                self.metrics.observe_output(state, recv.completion_tokens[i], now, self._first_token_time(state, recv, i))
            if finish_reason is not None:
                state.finished = True
                state.finished_time = now
                meta_info["e2e_latency"] = now - state.created_time
                self._drop_state(rid)
                # an abort counts as a finished request once it produced tokens, as SGLang's do (an
                # abort while waiting, or a full queue's 503, never ran: not a request served)
                if state.obj.log_metrics and (not is_abort or recv.completion_tokens[i] > 0):
                    self.metrics.observe_finished(state, recv.prompt_tokens[i], recv.completion_tokens[i], recv.cached_tokens[i])
            state.out_list.append(out)
            state.event.set()

    def _handle_embedding_output(self, recv: BatchEmbeddingOutput) -> None:
        """Finished embedding requests: each rid's one answer (SGLang's out_dict for a
        BatchEmbeddingOutput, with cached_tokens, which minisgl always reports)."""
        now = time.perf_counter()
        for i, rid, state in self._live_states(recv):
            self._drop_state(rid)  # (an embedding is sent once, finished)
            state.finished = True
            state.finished_time = now
            finish_reason = recv.finished_reasons[i]
            is_abort = isinstance(finish_reason, dict) and finish_reason.get("type") == "abort"
            if state.obj.log_metrics and not is_abort:  # a request served: its prompt, latency, cache hits
                self.metrics.observe_finished(state, recv.prompt_tokens[i], 0, recv.cached_tokens[i])
            if state.abandoned:  # its reader is gone
                continue
            meta_info: Dict[str, Any] = {
                "id": rid,
                "finish_reason": finish_reason,
                "prompt_tokens": recv.prompt_tokens[i],
                "cached_tokens": recv.cached_tokens[i],
                "weight_version": self.weight_version,
                "e2e_latency": now - state.created_time,
            }
            state.out_list.append({"embedding": recv.embeddings[i], "meta_info": meta_info})
            state.event.set()

    @staticmethod
    def _first_token_time(state: ReqState, recv: BatchStrOutput, i: int) -> Optional[float]:
        """When the first token existed, for a non-streaming request (SGLang 0.5.23: the scheduler's
        prefill_finished_time): its first message comes only after 50 tokens, or at the end. The
        scheduler's own TTFT (receive -> prefill done) after this process's tokenization; None
        for a stream, whose first message is its first token."""
        if state.obj.stream or i >= len(recv.time_stats):
            return None
        ttft_ms = recv.time_stats[i].get("ttft_ms")
        return state.tokenize_finish_time + ttft_ms / 1e3 if ttft_ms is not None and state.tokenize_finish_time else None

    async def health_generate(self, timeout: float = HEALTH_CHECK_TIMEOUT) -> bool:
        """SGLang's /health_generate: send a one-token request and report whether the
        pipeline (scheduler, model, detokenizer) answers anything within `timeout`.

        Any output counts, not only this request's: a busy server answers others' requests
        at once. A process that is alive but stuck (a deadlock, a stopped process) answers
        nothing, which /health, a liveness check, cannot see."""
        tic = time.time()
        obj: Union[GenerateReqInput, EmbeddingReqInput]
        if self.is_embedding:  # (SGLang's probe on an embedding server: a one-token embedding)
            obj = EmbeddingReqInput(input_ids=[0], rid=f"HEALTH_CHECK_{new_rid()}")
        else:
            obj = GenerateReqInput(
                input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=f"HEALTH_CHECK_{new_rid()}"
            )

        obj.log_metrics = False  # a probe, not a request: kept out of /metrics, as in SGLang

        async def run() -> None:
            try:
                async for _ in self.generate_request(obj):
                    pass
            except (ReqAbortedError, ValueError):  # a full queue's 503, a shutdown: any answer counts
                pass

        # on success the one-token request finishes by itself; on failure it is cancelled,
        # which aborts it as a client disconnect would
        task = asyncio.get_running_loop().create_task(run())
        self._health_checks.add(task)
        task.add_done_callback(self._health_checks.discard)
        while time.time() < tic + timeout:
            if self.last_receive_tstamp > tic:
                return True
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its abort is sent
        # a stuck pipeline may never answer that abort: forget the probe now, as SGLang does,
        # or every failed probe would leave its rid in flight for good
        if obj.rid in self.rid_to_state:
            self._drop_state(obj.rid)
        return False

    def fail_all_requests(self, message: str, status_code: int = 503) -> None:
        """End every request in flight as an abort carrying `message`, here, as the scheduler's
        own abort would: for when nothing else will answer them (a child process died, or a
        shutdown outlasted the scheduler). A waiting handler then answers its client (a 503, or
        an error event and [DONE] on a stream) instead of being cancelled into a bare 500."""
        self._finish_locally(list(self.rid_to_state), {"type": "abort", "message": message, "status_code": status_code})

    def _finish_locally(self, rids: List[str], reason: Dict[str, Any]) -> None:
        """Finish `rids` here with `reason`, through the same path as the scheduler's outputs."""
        states = [self.rid_to_state[rid] for rid in rids]
        self._handle_batch_output(
            BatchStrOutput(
                rids=rids,
                finished_reasons=[dict(reason) for _ in rids],
                output_strs=["" for _ in rids],
                output_ids=[[] for _ in rids],
                prompt_tokens=[state.prompt_tokens for state in states],
                completion_tokens=[len(state.output_ids) for state in states],
                cached_tokens=[0 for _ in rids],
            )
        )

    def close(self) -> None:
        if self.dynamic_batch_tokenizer is not None:
            self.dynamic_batch_tokenizer.close()
        self.context.destroy(linger=0)


def _clip(value: Any, limit: int = LOG_REQUEST_CHARS) -> str:
    """repr(value), cut to `limit` characters for --log-requests (SGLang logs partial input and
    output by default): a 10 MB prompt was one 10 MB log line, written on the event loop."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _text_chars(obj: GenerateReqInput) -> int:
    """Characters a single request's tokenization reads: its prompt text and its stop strings."""
    stop = (obj.sampling_params or {}).get("stop") if isinstance(obj.sampling_params, dict) else None
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    text = obj.text if isinstance(obj.text, str) else ""
    return len(text) + sum(len(s) for s in stops if isinstance(s, str))


def coalesce_streaming_chunks(out_list: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Several queued delta chunks -> one: texts, ids and logprobs concatenated, last meta_info."""
    if len(out_list) == 1:
        return out_list[0]
    meta = copy.copy(out_list[-1]["meta_info"])
    for key in LOGPROB_META_KEYS:
        meta[key] = [lp for out in out_list for lp in out["meta_info"][key]]
    if "hidden_states" in meta:
        meta["hidden_states"] = [entry for out in out_list for entry in out["meta_info"]["hidden_states"]]
    return {
        "text": "".join(out["text"] for out in out_list),
        "output_ids": [t for out in out_list for t in out["output_ids"]],
        "meta_info": meta,
    }
