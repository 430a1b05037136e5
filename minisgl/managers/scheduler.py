"""Scheduler (stage 3). In: TokenizedGenerateReqInput (TokenizedEmbeddingReqInput with
--is-embedding), AbortReq, control requests. Out: BatchTokenIDOutput (BatchEmbeddingOutput)
to the detokenizer, control replies (to the tokenizer).
Owns: waiting_queue, running_batch, chunked_req, the RadixCache, new_token_ratio.

One iteration (`run_step`) is SGLang's event_loop_normal body without the I/O:

    batch = get_next_batch_to_run()   # stash chunk, merge last prefill, prefill first, else decode
    result = run_batch(batch)         # ModelRunner.forward + sample (forward only: embeddings)
    process_batch_result(batch, result)  # append tokens, finish, release, stream

The class does no socket I/O (STYLE.md habit 7): inputs arrive through
`process_input_requests(msgs)`, outputs are collected and handed out by
`pop_outputs()` (and a control reply answered after a step, a LoRA unload's that waited for the
adapter's requests, by `pop_control_replies()`). Result processing and streaming live in
scheduler_output_processor_mixin.py, log lines and `snapshot()` in
scheduler_metrics_mixin.py, the torch.profiler and the named ranges of a step in
scheduler_profiler_mixin.py (SGLang's split). The Engine calls these directly; `event_loop_normal` at the bottom
of this file is the thin ZMQ shell the server runs in its own process. With --tp-size N each rank
runs one Scheduler; rank 0's shell broadcasts what it received, and the other ranks' shell
(tp_lockstep.follower_loop) feeds them the same, so all take the same decisions.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Set, Union

from minisgl.constrained.reasoner_grammar import REASONING_TAGS, ReasonerGrammar
from minisgl.constrained.xgrammar_backend import XGrammarGrammarBackend
from minisgl.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    FreezeGCReq,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetWeightsByNameReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ProfileReq,
    SchedulerSnapshotOut,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    decode,
    encode,
)
from minisgl.managers.schedule_batch import FINISH_ABORT, LEAST_PRIORITY, Req, ScheduleBatch, priority_text
from minisgl.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from minisgl.managers.scheduler_metrics_mixin import SchedulerMetricsMixin
from minisgl.managers.scheduler_output_processor_mixin import (
    EmbeddingBatchResult, GenerationBatchResult, SchedulerOutputProcessorMixin,
)  # fmt: skip
from minisgl.managers.scheduler_profiler_mixin import SchedulerProfilerMixin
from minisgl.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin
from minisgl.lora.lora_registry import LORA_NOT_ENABLED, LoRARef, lora_name_of, lora_not_loaded
from minisgl.managers.tokenization import RETURN_HIDDEN_STATES_DISABLED
from minisgl.managers.tp_lockstep import TpLeader, agree_on_ready_grammars, any_rank, fold_token_checksum, follower_loop, heartbeat_interval
from minisgl.managers.tp_process import (
    RankOwnWarningsOnly, apply_torch_math_settings, exit_when_parent_exits, set_threads_per_rank, start_up_reported, torch_math_settings,
)  # fmt: skip
from minisgl.mem_cache.allocator import ceil_paged_tokens, new_page_slots
from minisgl.mem_cache.radix_cache import RadixCache
from minisgl.sampling.custom_logit_processor import CustomLogitProcessor, client_error_text
from minisgl.server_args import ServerArgs, chunked_prefill_enabled
from minisgl.speculative.ngram_worker import NGRAMWorker
from minisgl.utils import freeze_gc

logger = logging.getLogger("minisgl.scheduler")

# a request whose grammar has not compiled after this long is aborted (SGLang's limit is
# 10,000 polls of 5 ms: about 50 s); while it waits, the scheduler polls every 5 ms when idle
GRAMMAR_TIMEOUT = 60.0
GRAMMAR_POLL_INTERVAL = 0.005

# a request of the other kind than this scheduler serves (the TokenizerManager and the Engine refuse it
# first, with their own message): it ends with this 400, through the normal output path
EMBEDDING_SCHEDULER_REFUSES_GENERATION = "This server runs an embedding model (--is-embedding): it computes embeddings, not text"
EMBEDDING_NEEDS_EMBEDDING_SERVER = "An embedding request needs a server started with --is-embedding"

# new_token_ratio defaults (SGLANG_INIT_NEW_TOKEN_RATIO, ..._MIN_..._FACTOR, ..._DECAY_STEPS)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
class Scheduler(SchedulerOutputProcessorMixin, SchedulerMetricsMixin, SchedulerProfilerMixin, SchedulerUpdateWeightsMixin):
    def __init__(self, server_args: ServerArgs, model_runner: Any, tokenizer: Any = None) -> None:

        self.server_args = server_args
        self.model_runner = model_runner
        # this rank's place among --tp-size ranks: the schedulers take the same decisions from the same
        # inputs (managers/tp_lockstep.py), and agree on the one thing their threads decide, grammar compiles
        self.tp_group = model_runner.tp_group
        self.tokenizer = tokenizer
        self.model_config = model_runner.model_config
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool_allocator = model_runner.token_to_kv_pool_allocator
        self.page_size = model_runner.page_size
        self.max_total_num_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = model_runner.max_running_requests
        # --is-embedding: every request is prefilled only, and its result is an embedding (SGLang's name)
        self.is_generation = not server_args.is_embedding
        self.enable_lora = server_args.enable_lora  # --lora-paths / --enable-lora (the adapters: model_runner.lora_manager)
        # unloads waiting for their adapter's last request here (finish_lora_unloads, each step)
        self.pending_lora_unloads: List[UnloadLoRAAdapterReqInput] = []
        self._control_replies: List[Any] = []  # replies answered after their step (pop_control_replies)
        # weight updates waiting for the requests in flight to finish (finish_weight_updates, each step)
        self.pending_weight_updates: List[Any] = []
        # the process shell (event_loop_normal) pauses its watchdogs with this around work that is
        # slow but not hung: writing a profile's trace, reading a LoRA adapter from disk
        self.watchdogs_paused: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        # --enable-priority-scheduling: +1 orders lower values first, -1 higher ones (SGLang's default)
        self.priority_order = (1 if server_args.schedule_low_priority_values_first else -1) if server_args.enable_priority_scheduling else None
        self.tree_cache = RadixCache(
            self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size, disable=server_args.disable_radix_cache,
            eviction_policy=server_args.radix_eviction_policy, priority_order=self.priority_order,
        )  # fmt: skip
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.random_seed, self.priority_order)
        # max_req_len bounds prompt + output; prompts stay 5 tokens below it (tp_worker.py)
        self.max_req_len = min(self.model_config.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        if self.max_req_input_len < 2:  # prompts must stay below it: not even one token would fit
            raise ValueError(
                f"The context length ({self.model_config.context_len}) and the KV pool ({self.max_total_num_tokens} "
                f"tokens) leave no room for a prompt: prompts must be shorter than min(context - 1, pool - 1) - 5 "
                f"= {self.max_req_input_len} tokens. Use --max-total-tokens and --context-length of at least 8."
            )
        self.chunked_prefill_size = server_args.chunked_prefill_size if chunked_prefill_enabled(server_args) else None
        self.is_mixed_chunk = self.chunked_prefill_size is not None and server_args.enable_mixed_chunk
        # --speculative-algorithm NGRAM: drafts for the running requests, checked by TARGET_VERIFY passes
        self.draft_worker = (
            NGRAMWorker(
                server_args.speculative_num_draft_tokens,
                server_args.speculative_ngram_min_match_window_size,
                server_args.speculative_ngram_max_match_window_size,
                # (a verify pass computes a logits row per token: bounded like a prefill chunk's tokens,
                # 2,048 when chunking is off)
                max_total_drafts=self.chunked_prefill_size or 2048,
            )
            if server_args.speculative_algorithm == "NGRAM"
            else None
        )
        # The EOS ids that end a request (unless ignore_eos): the model's (config.json +
        # generation_config.json) and the tokenizer's. One set for Req.check_finished and for
        # the min_new_tokens mask, so a token that would stop a request is also held back.
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = set(self.model_config.hf_eos_token_ids) | ({tokenizer_eos} if tokenizer_eos is not None else set())

        self._grammar_backend: Optional[XGrammarGrammarBackend] = None  # (get_grammar_backend, at first use)
        self.grammar_queue: List[Req] = []  # requests whose grammar is compiling (move_ready_grammar_requests)
        self.waiting_queue: List[Req] = []
        self.running_batch = self._empty_batch()
        self.cur_batch: Optional[ScheduleBatch] = None
        self.last_batch: Optional[ScheduleBatch] = None
        self.chunked_req: Optional[Req] = None
        self.forward_ct = 0
        self.forward_ct_decode = 0
        self.token_checksum = 0  # --tp-size N: every token sampled so far, folded (tp_lockstep.fold_token_checksum)

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        self.num_retracted_reqs_total = 0
        self.num_rejected_queue_full = 0  # requests refused with 503 by --max-queued-requests, or evicted for a more important one
        self._last_queue_full_log = -1e9  # (monotonic time of the last queue-full warning)
        self.total_hit_tokens = 0
        self.total_input_tokens = 0
        self.last_prefill_log_time = time.perf_counter()
        self.last_decode_log_time = time.perf_counter()
        self.num_generated_tokens = 0
        # speculative decoding, in all: the requests' decoding passes (decode or verify rows), and the
        # tokens they gave; SGLang's "accept len" is their ratio since the last log line
        self.spec_num_verify_rows = 0
        self.spec_num_verify_tokens = 0
        self._spec_logged = (0, 0)  # (the two at the last decode log line)
        self.last_gen_throughput = 0.0  # tokens/s of the last decode log line (sglang:gen_throughput)
        self._outputs: List[Union[BatchTokenIDOutput, BatchEmbeddingOutput, FreezeGCReq]] = []  # for the detokenizer
        self.events: List[Dict[str, Any]] = []
        self.finished_records: List[Dict[str, Any]] = []
        self._step_record_end = (0, 0)  # len(events), len(finished_records) when the last step ended
        self._idle_checked = True  # self_check_during_idle ran since the last batch
        self._reset_step_record()
        self.init_profiler()

    def _empty_batch(self) -> ScheduleBatch:
        return ScheduleBatch.init_new([], self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache)

    def _reset_step_record(self) -> None:
        """Start the record of what this step did, for snapshot(): events, finished requests,
        adder record, log line.

        What was recorded after the last step ended is kept: arrivals and aborts of waiting or
        mid-chunk requests happen between steps (process_input_requests), and they belong in
        the snapshot after the next step (Engine.step, the server's publish); Engine.snapshot()
        between steps shows them too.
        """
        num_events, num_finished = self._step_record_end
        self.events = self.events[num_events:]
        self.finished_records = self.finished_records[num_finished:]
        self.adder_record: Optional[Dict[str, Any]] = None
        self.log_line = ""

    def _event(self, type_: str, req: Req, detail: str = "") -> None:
        self.events.append({"type": type_, "rid": req.rid, "detail": detail})

    # ------------------------------------------------------------------ inputs
    def process_input_requests(self, recv_reqs: List[Any]) -> List[Any]:
        """Dispatch each message by type; returns the control replies for the tokenizer."""
        replies: List[Any] = []
        for msg in recv_reqs:
            # (a range per message, none around the loop: a ProfileReq starts or stops the
            # profiler here, and a range must not be open across that)
            if isinstance(msg, TokenizedGenerateReqInput):
                with self.trace_range("handle_generate_request"):
                    self.handle_generate_request(msg)
            elif isinstance(msg, TokenizedEmbeddingReqInput):
                with self.trace_range("handle_embedding_request"):
                    self.handle_embedding_request(msg)
            elif isinstance(msg, AbortReq):
                with self.trace_range("abort_request"):
                    self.abort_request(msg)
            elif isinstance(msg, ProfileReq):
                replies.append(self.profile(msg))
            elif isinstance(msg, FlushCacheReqInput):
                replies.append(self.flush_cache())
            elif isinstance(msg, GetLoadReqInput):
                replies.append(self.get_load())
            elif isinstance(msg, LoadLoRAAdapterReqInput):
                replies.append(self.load_lora_adapter(msg))
            elif isinstance(msg, UnloadLoRAAdapterReqInput):
                reply = self.unload_lora_adapter(msg)
                if reply is not None:  # (else answered once its adapter's requests finished: pop_control_replies)
                    replies.append(reply)
            elif isinstance(msg, (UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput)):
                with self.watchdogs_paused():  # (reading a checkpoint takes what it takes: not a hung step)
                    reply = self.update_weights(msg)
                if reply is not None:  # (else held until the requests in flight finish: pop_control_replies)
                    replies.append(reply)
            elif isinstance(msg, GetWeightsByNameReqInput):
                replies.append(self.get_weights_by_name(msg))
            elif isinstance(msg, FreezeGCReq):
                freeze_gc("Scheduler")
                self._outputs.append(msg)  # on to the detokenizer, after the outputs already queued
            else:
                raise TypeError(f"the scheduler does not handle {type(msg).__name__}")
        return replies

    def handle_generate_request(self, recv_req: TokenizedGenerateReqInput) -> Req:
        """Build the Req, then SGLang's gates (§1.5), with truncation before the max_new_tokens clamp."""
        # (the TokenizerManager and the Engine refuse an unknown adapter first.) A load this scheduler
        # does not hold is left off the Req: its one-token prefill runs on the base model, and its
        # radix namespace (extra_key) never carries an id whose weights are gone
        lora_error = self.check_lora_id(recv_req.lora_id) if recv_req.lora_id is not None else None
        req = Req(
            recv_req.rid,
            recv_req.input_text,
            recv_req.input_ids,
            recv_req.sampling_params,
            return_logprob=recv_req.return_logprob,
            logprob_start_len=recv_req.logprob_start_len,
            top_logprobs_num=recv_req.top_logprobs_num,
            token_ids_logprob=recv_req.token_ids_logprob,
            stream=recv_req.stream,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.model_config.vocab_size,
            tokenizer=self.tokenizer,
            priority=recv_req.priority,
            require_reasoning=recv_req.require_reasoning,
            return_hidden_states=recv_req.return_hidden_states,
            lora_id=recv_req.lora_id if lora_error is None else None,
            cache_key=recv_req.extra_key,
        )
        if self.priority_order is not None and req.priority is None:
            req.priority = self.priority_order * LEAST_PRIORITY  # (SGLang's default: the least important)
        self._event("arrive", req, f"input_len={len(req.origin_input_ids)}")
        # SGLang clamps max_new_tokens first, on the prompt as it came; a prompt that
        # --allow-auto-truncate then cuts would keep that clamp and have no room to generate.
        # Truncate first, then clamp on the prompt that will run.
        error_msg = self.validate_input_length(req)
        self.init_req_max_new_tokens(req)
        if not self.is_generation:  # (the TokenizerManager and the Engine refuse it first)
            error_msg = EMBEDDING_SCHEDULER_REFUSES_GENERATION
        if error_msg is None and req.return_hidden_states and not self.server_args.enable_return_hidden_states:
            error_msg = RETURN_HIDDEN_STATES_DISABLED  # (the TokenizerManager and the Engine refuse it first)
        if error_msg is None:
            error_msg = lora_error
        if error_msg is None and recv_req.custom_logit_processor is not None:
            error_msg = self.load_custom_logit_processor(req, recv_req.custom_logit_processor)
        if req.sampling_params.stop_regex_strs and self.tp_group.world_size > 1:  # (its search budget is each rank's time)
            req.stop_regex_timed_out_anywhere = functools.partial(any_rank, self.tp_group)
        if error_msg is not None:
            req.set_finish_with_abort(error_msg)
            self._add_request_to_queue(req)
            return req
        # logprob_start_len fix-ups (SGLang 0.5.23's): -1 asks for output logprobs only, i.e.
        # prompt logprobs from the end of the prompt, which is none of them
        if not req.return_logprob:
            req.logprob_start_len = -1
        elif req.logprob_start_len == -1:
            req.logprob_start_len = len(req.origin_input_ids)
        if req.logprob_start_len > len(req.origin_input_ids):
            req.set_finish_with_abort(
                f"logprob_start_len={req.logprob_start_len} is higher than the number of input tokens "
                f"{len(req.origin_input_ids)}. Request with a lower logprob_start_len."
            )
        elif req.sampling_params.grammar_key is not None:
            try:
                req.grammar_future = self.get_grammar_backend().get_future(req.sampling_params.grammar_key)
            except ValueError as e:
                req.set_finish_with_abort(str(e), param=req.sampling_params.grammar_key[0])
            else:
                # SGLang's grammar queue: the request waits there while its grammar compiles
                # (a cached one is ready at once) and joins the waiting queue when it is
                self.grammar_queue.append(req)
                self.move_ready_grammar_requests(may_wait=False)  # (a cached grammar: on to the waiting queue now)
                return req
        self._add_request_to_queue(req)
        return req

    def handle_embedding_request(self, recv_req: TokenizedEmbeddingReqInput) -> Req:
        """An embedding model's request (SGLang's handle_embedding_request): max_new_tokens 0, so
        it is prefilled only (in chunks if long), reserves no output tokens, and finishes with its
        last chunk (process_batch_result_prefill); the length gate as for any prompt."""
        req = Req(
            recv_req.rid, recv_req.input_text, recv_req.input_ids, recv_req.sampling_params,
            vocab_size=self.model_config.vocab_size, tokenizer=self.tokenizer,
        )  # fmt: skip
        req.dimensions = recv_req.dimensions
        if self.priority_order is not None:  # (the waiting queue sorts by it: the least important)
            req.priority = self.priority_order * LEAST_PRIORITY
        self._event("arrive", req, f"input_len={len(req.origin_input_ids)}")
        error_msg = self.validate_input_length(req)
        if self.is_generation:  # (the TokenizerManager and the Engine refuse it first)
            error_msg = EMBEDDING_NEEDS_EMBEDDING_SERVER
        if error_msg is not None:
            req.set_finish_with_abort(error_msg)
        self._add_request_to_queue(req)
        return req

    def load_custom_logit_processor(self, req: Req, processor_str: str) -> Optional[str]:
        """Load a request's custom logit processor onto it, once, on arrival; the error (the request's
        400) when the server does not run processors or the string does not load. Runs the
        client's code (dill): see sampling/custom_logit_processor.py."""
        if not self.server_args.enable_custom_logit_processor:  # (the TokenizerManager and the Engine refuse it first)
            return "custom_logit_processor needs --enable-custom-logit-processor (it runs the client's code on the server)"
        try:
            processor = CustomLogitProcessor.from_str(processor_str)
        except ValueError as e:
            return str(e)
        except (Exception, SystemExit) as e:  # (loading runs the client's code: whatever it raises is its request's 400)
            return f"custom_logit_processor does not load here: {client_error_text(e)}"
        req.custom_logit_processor = processor_str
        req.custom_logit_processor_instance = processor
        # its own copy (JSON, checked so): the Engine hands over the caller's dict, which n > 1 and
        # a batch's prompts share, and a processor may keep state in it
        own = json.loads(json.dumps(req.sampling_params.custom_params or {}))
        req.custom_params = {**own, "__req__": req}  # SGLang's __req__
        return None

    def get_grammar_backend(self) -> XGrammarGrammarBackend:
        """The grammar compiler (structured output), built at the first request that needs it:
        a server that never sees one never imports xgrammar. ValueError (the request's 400)
        says why there is none."""
        if self.server_args.grammar_backend == "none":
            raise ValueError("Structured output is off here (--grammar-backend none; grammar_backend='none' in an Engine)")
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("Structured output needs the tokenizer: the grammar is compiled against its vocabulary")
            try:
                self._grammar_backend = XGrammarGrammarBackend(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                    any_whitespace=not self.server_args.constrained_json_disable_any_whitespace,
                )  # fmt: skip
            except ImportError as e:
                raise ValueError(str(e)) from None
            except Exception as e:  # a broken install (OSError from its native library), a tokenizer it cannot read
                logger.exception("The grammar backend failed to load")
                raise ValueError(f"Structured output is unavailable: the grammar backend failed to load ({type(e).__name__}: {e})") from None
        return self._grammar_backend

    def move_ready_grammar_requests(self, may_wait: bool = True) -> None:
        """Move the requests whose grammar has compiled from the grammar queue to the waiting
        queue (SGLang's get_ready_grammar_requests), each with its own matcher; one that did not
        compile, or took longer than GRAMMAR_TIMEOUT, is aborted with a 400 (it runs a
        one-token prefill to carry the error out, as every rejected request does).

        With --tp-size N the compiles finish on each rank's own threads, at different times:
        the ranks agree first (a grammar is ready once ready on every rank; the timeout is rank
        0's clock), so every scheduler moves the same requests (tp_lockstep.agree_on_ready_grammars)."""
        if not self.grammar_queue:
            return
        if may_wait and not self.waiting_queue and not self._unfinished_reqs() and self.chunked_req is None:
            # nothing else to do: wait a little for a compile instead of spinning (SGLang's poll)
            wait([r.grammar_future for r in self.grammar_queue], timeout=GRAMMAR_POLL_INTERVAL, return_when=FIRST_COMPLETED)
        now = time.perf_counter()
        queue = list(self.grammar_queue)
        ready, timed_out = agree_on_ready_grammars(
            self.tp_group,
            [r.grammar_future.done() for r in queue],
            [now - r.time_stats.scheduler_recv_time > GRAMMAR_TIMEOUT for r in queue],
        )  # fmt: skip
        for req, is_ready, is_timed_out in zip(queue, ready, timed_out):
            future = req.grammar_future
            if is_ready:
                try:
                    req.grammar = self._grammar_backend.get_grammar(future)
                    if req.require_reasoning:  # (held only from the end of the thinking on)
                        _, end, _ = REASONING_TAGS[self.server_args.reasoning_parser or "qwen3"]
                        req.grammar = ReasonerGrammar(req.grammar, end, self.tokenizer.decode)
                except ValueError as e:
                    req.set_finish_with_abort(str(e), param=req.sampling_params.grammar_key[0])
            elif is_timed_out:
                busy = "" if future.running() else " (it was still waiting for a compile thread: other grammars were compiling)"
                req.set_finish_with_abort(
                    f"Its {req.sampling_params.grammar_key[0]} did not compile within {GRAMMAR_TIMEOUT:g} s{busy}; "
                    f"a smaller or less nested one compiles faster",
                    param=req.sampling_params.grammar_key[0],
                )
                self.grammar_queue.remove(req)
                self._release_grammar_future(req)
                self._add_request_to_queue(req)
                continue
            else:
                continue
            self.grammar_queue.remove(req)
            req.grammar_future = None
            self._add_request_to_queue(req)

    def _release_grammar_future(self, req: Req) -> None:
        """A request leaves the grammar queue unserved: its compile is skipped if it has not started
        and no other queued request waits for the same grammar."""
        future, req.grammar_future = req.grammar_future, None
        if future is not None and not any(r.grammar_future is future for r in self.grammar_queue):
            self._grammar_backend.release(future)

    def init_req_max_new_tokens(self, req: Req) -> None:
        """The single most important clamp: prompt + output must fit max_req_len."""
        params = req.sampling_params
        requested = params.max_new_tokens if params.max_new_tokens is not None else 1 << 30
        params.max_new_tokens = max(min(requested, self.max_req_len - len(req.origin_input_ids) - 1), 0)

    def validate_input_length(self, req: Req) -> Optional[str]:
        if len(req.origin_input_ids) < self.max_req_input_len:
            return None
        if self.server_args.allow_auto_truncate:
            logger.warning(
                "Request length is longer than the KV cache pool size or the max context length. "
                "Truncated. len(origin_input_ids)=%d, max_req_input_len=%d",
                len(req.origin_input_ids),
                self.max_req_input_len,
            )
            # SGLang's cut, one token longer than what the gate accepts uncut; the tokenizer's
            # own gate (tokenization.validate_context_length) has already cut to max_req_input_len - 1
            req.origin_input_ids = req.origin_input_ids[: self.max_req_input_len]
            return None
        return (
            f"Input length ({len(req.origin_input_ids)} tokens) exceeds the maximum allowed length "
            f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
        )

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        max_queued = self.server_args.max_queued_requests
        # (a request that already carries its error, a 400, only passes through to report it:
        # never refused for a full queue, nor evicting, nor evicted)
        if not is_retracted and req.to_finish is None and max_queued is not None and self._num_queued() >= max_queued:
            rejected = self._queue_full_victim(req)
            if rejected is req:
                message, detail = "The request queue is full.", "queue full"
            else:
                message = "The request is aborted by a higher priority request."
                detail = f"queue full: evicted by {req.rid} (priority {priority_text(req.priority)} over {priority_text(rejected.priority)})"
            rejected.finished_reason = FINISH_ABORT(message, 503, "ServiceUnavailableError")
            self._finish_without_running(rejected, detail)
            self.num_rejected_queue_full += 1
            now = time.monotonic()
            if now - self._last_queue_full_log >= 1.0:  # an operator's only trace of the 503s; once a second
                what = "rejected" if rejected is req else f"evicted (for rid={req.rid}, more important)"
                logger.warning(
                    "The request queue is full (--max-queued-requests %d): %s rid=%s with 503 "
                    "(%d rejected or evicted so far)", max_queued, what, rejected.rid, self.num_rejected_queue_full,
                )  # fmt: skip
                self._last_queue_full_log = now
            if rejected is req:
                return
        now = time.perf_counter()
        if not req.time_stats.wait_queue_entry_time:
            req.time_stats.wait_queue_entry_time = now
        req.time_stats.last_wait_queue_entry_time = now
        self.waiting_queue.append(req)

    def _num_queued(self) -> int:
        """Queued requests that will run (one that carries its error only passes through)."""
        return sum(r.to_finish is None for r in self.waiting_queue)

    def _queue_full_victim(self, req: Req) -> Req:
        """Who leaves a full queue for `req` (SGLang's _abort_on_queued_limit): `req` itself, or, with
        priority scheduling, the least important queued request (of equals, the one queued last) when
        `req` is strictly more important. That one is taken out of the queue here."""
        if self.priority_order is None:
            return req
        order = self.priority_order
        candidates = [r for r in self.waiting_queue if r.to_finish is None]
        if not candidates:
            return req
        worst = max(candidates, key=lambda r: (order * r.priority, r.time_stats.last_wait_queue_entry_time))
        if order * req.priority >= order * worst.priority:
            return req
        self.waiting_queue.remove(worst)
        return worst

    def _finish_without_running(self, req: Req, detail: str) -> None:
        """A request that holds no memory ends here: report it through the normal output path."""
        req.time_stats.completion_time = time.perf_counter()
        self._event("abort", req, detail)
        self._record_finished(req)
        self.stream_output([req])

    def abort_request(self, recv_req: AbortReq) -> None:
        """Abort one rid, or all: waiting and mid-chunk requests at once, running ones after
        their next step. An empty rid aborts nothing. Exact rids only (SGLang matches by
        prefix, so aborting `a` also hit another client's `a-b`): the TokenizerManager
        sends the samples `<rid>-<j>` of an n > 1 request one by one."""
        rid = recv_req.rid

        def matches(req: Req) -> bool:
            return recv_req.abort_all or (rid != "" and req.rid == rid)

        for req in [r for r in self.waiting_queue if matches(r)]:
            self.waiting_queue.remove(req)
            req.finished_reason = FINISH_ABORT()
            self._finish_without_running(req, "aborted while waiting")
        for req in [r for r in self.grammar_queue if matches(r)]:
            self.grammar_queue.remove(req)
            self._release_grammar_future(req)
            req.finished_reason = FINISH_ABORT()
            self._finish_without_running(req, "aborted while its grammar compiled")
        if self.chunked_req is not None and matches(self.chunked_req):
            req, self.chunked_req = self.chunked_req, None
            # Its computed chunks are committed KV: they go into the tree like a finish.
            req.finished_reason = FINISH_ABORT()
            self._release_finished(req, "aborted mid-chunk")
            self.stream_output([req])
        for req in self._unfinished_reqs():
            if matches(req):
                # finished by the normal path after one more forward (SGLang's method 3)
                req.to_finish = FINISH_ABORT()

    def flush_cache(self) -> FlushCacheReqOutput:
        if not self.is_idle():
            return FlushCacheReqOutput(False, "Cache not flushed because there are pending requests.")
        # A fresh running batch, as SGLang's flush: filtering the old one would keep its
        # batch_is_full, which only a shrinking decode batch resets; with nothing left to
        # decode, every later request would wait forever.
        self.running_batch = self._empty_batch()
        self.last_batch = None
        self.tree_cache.reset()
        self.token_to_kv_pool_allocator.clear()
        self.req_to_token_pool.clear()
        if self._grammar_backend is not None:  # (SGLang's flush resets the compiled grammars too)
            self._grammar_backend.reset()
        return FlushCacheReqOutput(True, "Cache flushed.")

    def shutdown_grammar_backend(self) -> None:
        """Stop the grammar backend's threads and drop its compiled grammars (Engine.shutdown).
        Not waited for: a compile in progress ends on its own (and the process's exit waits for it)."""
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown(timeout=0)
            self._grammar_backend = None

    def get_load(self) -> GetLoadReqOutput:
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        used, usage = self._token_usage()
        total = self.total_hit_tokens + self.total_input_tokens
        return GetLoadReqOutput(
            # the running batch, the just-prefilled requests not yet merged into it, and the one
            # mid-chunk: a server busy prefilling a long prompt read as idle (finished requests
            # linger in running_batch until the next filter_batch, and are not counted)
            num_running_reqs=len(self._decoding_reqs()) + (self.chunked_req is not None and not self.chunked_req.finished()),
            num_waiting_reqs=len(self.waiting_queue) + len(self.grammar_queue),
            num_used_tokens=used,
            available_tokens=available,
            evictable_tokens=evictable,
            protected_tokens=self.tree_cache.protected_size(),
            max_total_num_tokens=self.max_total_num_tokens,
            token_usage=usage,
            cache_hit_rate=self.total_hit_tokens / total if total else 0.0,
            new_token_ratio=self.new_token_ratio,
            num_retracted_reqs_total=self.num_retracted_reqs_total,
            # the last decode log line's rate while requests run (SGLang's gauge); 0 when idle,
            # where SGLang's keeps the last value
            gen_throughput=self.last_gen_throughput if self._decoding_reqs() else 0.0,
        )

    def pop_outputs(self) -> List[Union[BatchTokenIDOutput, BatchEmbeddingOutput, FreezeGCReq]]:
        out, self._outputs = self._outputs, []
        return out

    def is_idle(self) -> bool:
        """Nothing compiling its grammar, waiting, running, mid-chunk, or just prefilled and not yet merged."""
        return not self.grammar_queue and not self.waiting_queue and self.chunked_req is None and not self._unfinished_reqs()

    def _unfinished_reqs(self) -> List[Req]:
        """Requests with a forward still to come: the running batch and the just-prefilled ones
        not yet merged into it (finished requests linger in running_batch until the next
        filter_batch, and hold nothing). A chunked request mid-prompt is among the latter."""
        reqs = [r for r in self.running_batch.reqs if not r.finished()]
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            known = {id(r) for r in reqs}
            reqs += [r for r in self.last_batch.reqs if not r.finished() and id(r) not in known]
        return reqs

    # ------------------------------------------------------------------ one iteration
    def run_step(self) -> Optional[ScheduleBatch]:
        """One scheduler iteration; returns the batch it ran (None when idle).

        While profiling, each stage is a range of the trace named after its function
        (trace_range; docs/scheduler.md): run_step holds get_next_batch_to_run, run_batch and
        process_batch_result_prefill / _decode."""
        with self.trace_range("run_step"):
            batch = self._run_step()
        if batch is not None:  # (after the ranges closed: the profile may stop here)
            self.count_profiled_step()
        return batch

    def _run_step(self) -> Optional[ScheduleBatch]:
        self._reset_step_record()
        self.move_ready_grammar_requests()
        with self.trace_range("get_next_batch_to_run"):
            batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None and self._idle_checked:  # the first step after an idle period
            # the log lines' rates measure this busy period, not the idle time before it
            now = time.perf_counter()
            self.last_decode_log_time = self.last_prefill_log_time = now
            self.num_generated_tokens, self.last_gen_throughput = 0, 0.0
        if batch is not None:
            with self.trace_range("run_batch"):
                result = self.run_batch(batch)
            # (SGLang's process_batch_result dispatches to these two by the batch's mode)
            with self.trace_range("process_batch_result_prefill" if batch.forward_mode.is_extend() else "process_batch_result_decode"):
                self.process_batch_result(batch, result)
        self.last_batch = batch
        if self.pending_lora_unloads:
            self.finish_lora_unloads()
        if self.pending_weight_updates:
            with self.watchdogs_paused():
                self.finish_weight_updates()
        self._step_record_end = (len(self.events), len(self.finished_records))
        if batch is not None:
            self._idle_checked = False  # busy again: check once more when it next goes idle
        return batch

    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """Stash the chunk, merge the last prefill into running, prefill first, else decode (§1.3)."""
        chunked_req_to_exclude = set()
        if self.chunked_req is not None:
            chunked_req_to_exclude.add(self.chunked_req)
            # the chunk computed so far goes into the tree; prefix_indices/last_node move on
            self.tree_cache.cache_unfinished_req(self.chunked_req, chunked=True)
        last_batch = self.last_batch
        if last_batch is not None and last_batch.forward_mode.is_extend():
            if last_batch.chunked_req is not None:
                chunked_req_to_exclude.add(last_batch.chunked_req)
            last_bs = last_batch.batch_size()
            last_batch.filter_batch(chunked_req_to_exclude=chunked_req_to_exclude)
            if last_batch.batch_size() < last_bs:
                self.running_batch.batch_is_full = False
            if not last_batch.is_empty() and not last_batch.is_prefill_only():
                self.running_batch.merge_batch(last_batch)
            # merged: the last batch must not be merged a second time
            self.last_batch = None
        # Requests that finished in the last decode step are still in running_batch (SGLang
        # drops them in the next update_running_batch). Drop them before admission, so the
        # prefill's request slots, its token reservation and the logs count only what still
        # runs: otherwise a finished request holds its slot one more step, and with
        # --max-running-requests 1 the next request waits through an empty step.
        if any(r.finished() for r in self.running_batch.reqs):
            self.running_batch.filter_batch()
            self.running_batch.batch_is_full = False

        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.running_batch = self.update_running_batch(self.running_batch)
            return None if self.running_batch.is_empty() else self.running_batch
        return None

    def get_num_allocatable_reqs(self, running_bs: int, rows_held: int = 0) -> int:
        """Request slots left: the running cap, and free req_to_token rows, plus `rows_held`:
        admitted requests that already own a row (the chunked request)."""
        return min(self.max_running_requests - running_bs, self.req_to_token_pool.available_size() + rows_held)

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        """Admit the chunked request first, then the waiting queue in policy order (§1.4)."""
        running_bs = len(self.running_batch.reqs)
        try_preemption = self.priority_order is not None
        if try_preemption:  # (SGLang's: a full batch may still make room for a more important request)
            self.running_batch.batch_is_full = False
        if (self.running_batch.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            reason = "BATCH_FULL" if self.running_batch.batch_is_full else "QUEUE_EMPTY"
            self.adder_record = self._record_without_adder(reason, running_bs)
            return None
        if self.get_num_allocatable_reqs(running_bs) <= 0 and self.chunked_req is None and not try_preemption:
            self.running_batch.batch_is_full = True
            self.adder_record = self._record_without_adder("BATCH_FULL", running_bs)
            return None

        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            self.running_batch,
            self.new_token_ratio,
            self.server_args.max_prefill_tokens,
            self.chunked_prefill_size,
            running_bs if self.is_mixed_chunk else 0,
            self.server_args.prefill_max_requests,
        )
        # Counted before add_chunked_req, which clears chunked_req on the last chunk while the
        # request (and its row) stays in can_run_list.
        rows_held = 1 if self.chunked_req is not None else 0
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        self._admit_waiting(adder, running_bs, rows_held)
        for req in adder.preempt_list:  # (back to the queue after the pass, which walked it)
            self._requeue_retracted(req)
        running_bs = len(self.running_batch.reqs)
        self.adder_record = adder.record()
        slots_left = self.get_num_allocatable_reqs(running_bs, rows_held) - len(adder.can_run_list)
        self.adder_record["budgets"]["request_slots_left"] = slots_left
        self.adder_record["budgets"]["total_tokens"] = self.max_total_num_tokens
        if not adder.can_run_list:
            return None
        return self._build_prefill_batch(adder, running_bs)

    def _admit_waiting(self, adder: PrefillAdder, running_bs: int, rows_held: int) -> None:
        """Offer queued requests until the first one that does not fit (head-of-line blocking);
        with priority scheduling, one that does not fit may preempt less important running ones.
        With --lora-paths, a request whose adapter would make the batch run more than
        max_loras_per_batch distinct adapters is skipped (SGLang's one `continue`), not a stop:
        the record's stop_detail names the skipped requests, whatever the stop reason."""
        skipped: List[Req] = []
        self._offer_waiting(adder, running_bs, rows_held, skipped)
        if skipped:
            if adder.stop_reason == "QUEUE_EMPTY":  # (not "admitted": some were held back)
                adder.stop_detail = "every waiting request was offered"
            names = ", ".join(f"{r.rid} (adapter {r.lora_id!r})" for r in skipped[:8]) + (", ..." if len(skipped) > 8 else "")
            adder.stop_detail += (
                f"; skipped for their LoRA adapter (the batch would run more than max_loras_per_batch="
                f"{self.server_args.max_loras_per_batch} adapters): {names}"
            )

    def _offer_waiting(self, adder: PrefillAdder, running_bs: int, rows_held: int, skipped: List[Req]) -> None:
        """_admit_waiting's walk of the queue; appends each request skipped for its adapter to `skipped`."""
        # the adapters the pass already runs (None: the base model), built once per pass: the
        # running batch changes only on a preemption, the admitted ones only on an admission
        batch_loras = self._batch_loras(adder) if self.enable_lora else set()
        for req in self.waiting_queue:
            if self.enable_lora and len(batch_loras | {req.lora_id}) > self.server_args.max_loras_per_batch:
                skipped.append(req)
                continue
            no_slot = len(adder.can_run_list) >= self.get_num_allocatable_reqs(running_bs, rows_held)
            if no_slot:
                self.running_batch.batch_is_full = True
            if self.running_batch.batch_is_full:
                if not self._preempt_for(adder, req, no_slot):
                    adder.record_stop("BATCH_FULL", f"no request slot left (max_running_requests={self.max_running_requests})")
                    return
                running_bs = len(self.running_batch.reqs)
                batch_loras = self._batch_loras(adder) if self.enable_lora else set()
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req)
            # (NO_TOKEN may also come after `req` was admitted, when it used up the budget: then
            # nothing is preempted for it)
            admitted = any(r is req for r in adder.can_run_list)
            if res == AddReqResult.NO_TOKEN and not admitted and self._preempt_for(adder, req, no_slot=False):
                adder.stop_reason = None  # (room was made: offered again)
                running_bs = len(self.running_batch.reqs)
                res = adder.add_one_req(req)
                batch_loras = self._batch_loras(adder) if self.enable_lora else set()
            if any(r is req for r in adder.can_run_list):
                batch_loras.add(req.lora_id)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    # only "full" if something holds memory that will come back (0.5.23)
                    self.running_batch.batch_is_full = len(adder.can_run_list) > 0 or not self.running_batch.is_empty()
                elif req is self.waiting_queue[-1] and adder.can_run_list and adder.can_run_list[-1] is req and adder.new_chunked_req is not req:
                    # the last request, admitted whole, used up a budget (SGLang's OTHER): no one was
                    # held back, which is what the record is read for
                    adder.record_stop("QUEUE_EMPTY", "every waiting request was admitted (the last one used up a budget)", replace=True)
                return
        adder.record_stop("QUEUE_EMPTY", "every waiting request was admitted")

    def _batch_loras(self, adder: PrefillAdder) -> Set[Optional[str]]:
        """The distinct adapters of the running requests and of those admitted so far (None: the
        base model). As SGLang's LoRAManager.validate_lora_batch, the base model counts as one:
        max_loras_per_batch 1 lets a batch run one adapter, or the base model alone."""
        return {r.lora_id for r in self.running_batch.reqs} | {r.lora_id for r in adder.can_run_list}

    def check_lora_id(self, lora_id: str) -> Optional[str]:
        """The error of a request naming an adapter load this server does not hold, or one being
        unloaded (None: it may run with it). Worded with the adapter's name, as the client sent it."""
        manager = self.model_runner.lora_manager
        if manager is None:
            return LORA_NOT_ENABLED
        name = lora_name_of(lora_id)
        if any(u.lora_id == lora_id for u in self.pending_lora_unloads):
            return f"LoRA adapter {name!r} is being unloaded; load it again (/load_lora_adapter) to use it"
        if lora_id not in manager.adapters:
            if name in manager.loaded_adapters():  # (another load of that name now)
                return f"LoRA adapter {name!r} was unloaded and loaded again while this request was on its way: send it again"
            return lora_not_loaded(name, manager.loaded_adapters())
        return None

    def load_lora_adapter(self, recv_req: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """/load_lora_adapter's work: the LoRAManager reads and checks the adapter under its new
        lora_id; a refusal (or a broken file) is the reply's error, and nothing changed. Reading a
        big adapter from a slow disk takes long, not forever: the server's watchdogs are paused."""
        manager = self.model_runner.lora_manager
        if manager is None:
            return LoRAUpdateOutput(False, LORA_NOT_ENABLED)
        try:
            assert recv_req.lora_id is not None, "the TokenizerManager mints the lora_id"
            with self.watchdogs_paused():
                manager.load_lora_adapter(LoRARef(recv_req.lora_id, recv_req.lora_name, recv_req.lora_path, recv_req.pinned))
        except ValueError as e:
            return LoRAUpdateOutput(False, str(e), manager.loaded_adapters())
        except Exception as e:  # (a file safetensors cannot read, ...): the load fails, the server goes on
            logger.exception("Loading LoRA adapter %s failed", recv_req.lora_name)
            return LoRAUpdateOutput(False, f"LoRA adapter {recv_req.lora_name!r} failed to load: {type(e).__name__}: {e}", manager.loaded_adapters())
        return LoRAUpdateOutput(True, None, manager.loaded_adapters())

    def unload_lora_adapter(self, recv_req: UnloadLoRAAdapterReqInput) -> Optional[LoRAUpdateOutput]:
        """/unload_lora_adapter's last step: drop the weights of a load. While a request here still
        runs with it (queued, running, mid-chunk, compiling its grammar), the unload waits in
        pending_lora_unloads and is answered after the step its last request finished in
        (finish_lora_unloads; None here): the TokenizerManager waits for its own requests first,
        as SGLang's does, and this makes the weights' removal safe whatever that count says."""
        manager = self.model_runner.lora_manager
        if manager is None:
            return LoRAUpdateOutput(False, LORA_NOT_ENABLED)
        lora_id = recv_req.lora_id or ""
        if lora_id not in manager.adapters:
            return LoRAUpdateOutput(False, lora_not_loaded(recv_req.lora_name, manager.loaded_adapters()), manager.loaded_adapters())
        if any(u.lora_id == lora_id for u in self.pending_lora_unloads):
            return LoRAUpdateOutput(False, f"LoRA adapter {recv_req.lora_name!r} is being unloaded already", manager.loaded_adapters())
        in_use = self.reqs_of_lora(lora_id)
        if in_use:
            logger.info("Unload of LoRA adapter %s waits for %d request(s) using it", recv_req.lora_name, len(in_use))
            self.pending_lora_unloads.append(recv_req)
            return None
        manager.unload_lora_adapter(lora_id)
        return LoRAUpdateOutput(True, None, manager.loaded_adapters())

    def finish_lora_unloads(self) -> None:
        """Each step's end: the pending unloads whose adapter no request here uses any more drop its
        weights; their replies wait in pop_control_replies for the process shell."""
        for recv_req in [u for u in self.pending_lora_unloads if not self.reqs_of_lora(u.lora_id)]:
            self.pending_lora_unloads.remove(recv_req)
            self.model_runner.lora_manager.unload_lora_adapter(recv_req.lora_id)
            self._control_replies.append(LoRAUpdateOutput(True, None, self.model_runner.lora_manager.loaded_adapters()))

    def pop_control_replies(self) -> List[Any]:
        """Control replies answered after a step (a deferred unload's), for the tokenizer."""
        out, self._control_replies = self._control_replies, []
        return out

    def reqs_of_lora(self, lora_id: Optional[str]) -> List[Req]:
        """The requests here that will still run a forward with adapter load `lora_id`."""
        reqs = self.grammar_queue + self.waiting_queue + self._unfinished_reqs()
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return list({id(r): r for r in reqs if r.lora_id == lora_id and not r.finished()}.values())

    def _preempt_for(self, adder: PrefillAdder, req: Req, no_slot: bool) -> bool:
        """Priority preemption for `req` (--enable-priority-scheduling): whether it freed room."""
        if self.priority_order is None:
            return False
        req.init_next_round_input(self.tree_cache)  # (its extend length, against the tree as it is now)
        before = len(adder.preempt_list)
        threshold = self.server_args.priority_scheduling_preemption_threshold
        # its matched prefix locked: the victims' release evicts from the tree, and must not take
        # the nodes `req` matched (it is admitted with them); its need is counted as add_one_req counts it
        with adder.lock_node(req.last_node):
            if not adder.preempt_to_schedule(req, threshold, self.priority_order, need_slot=no_slot):
                return False
        victims = adder.preempt_list[before:]
        for victim in victims:
            self._event("retract", victim, f"preempted by {req.rid} (priority {priority_text(req.priority)} over {priority_text(victim.priority)})")
        logger.info("Priority preemption: rid=%s (priority %s) sent %d running request(s) back to the queue", req.rid, priority_text(req.priority), len(victims))
        return True

    def _requeue_retracted(self, req: Req) -> None:
        """A retracted (or preempted) request goes back to the queue, its KV freed already; one
        aborted while running ends here instead, with what it has (queued again, it would be
        prefilled once more only to finish then)."""
        if req.to_finish is not None:
            req.finished_reason, req.to_finish = req.to_finish, None
            self._finish_without_running(req, "aborted while retracted")
        else:
            self._add_request_to_queue(req, is_retracted=True)

    def _record_without_adder(self, reason: str, running_bs: int) -> Dict[str, Any]:
        slots = self.get_num_allocatable_reqs(running_bs)
        if reason == "QUEUE_EMPTY":
            detail = "waiting queue is empty"
        elif slots <= 0:
            detail = f"no request slot left (max_running_requests={self.max_running_requests})"
        else:  # slots are free: SGLang's batch_is_full, set when admission last ran out of KV tokens
            detail = "batch_is_full: the last admission ran out of KV tokens (NO_TOKEN); none until a request leaves"
        return {
            "stop_reason": reason,
            "stop_detail": detail,
            "budgets": {
                "rem_total_tokens": None,
                "rem_input_tokens": None,
                "rem_chunk_tokens": None,
                "max_prefill_tokens": self.server_args.max_prefill_tokens,
                "chunked_prefill_size": self.chunked_prefill_size,
                "prefill_max_requests": self.server_args.prefill_max_requests,
                "num_admitted": 0,
                "request_slots_left": slots,
                "total_tokens": self.max_total_num_tokens,
            },
            "admitted": [],
        }

    def _build_prefill_batch(self, adder: PrefillAdder, running_bs: int) -> ScheduleBatch:
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "at most one request is mid-chunk"
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        now = time.perf_counter()
        for req in adder.can_run_list:
            if not req.time_stats.forward_entry_time:
                req.time_stats.forward_entry_time = now
        new_batch = ScheduleBatch.init_new(
            adder.can_run_list, self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache, self.chunked_req
        )
        new_batch.prepare_for_extend()
        for req in adder.can_run_list:
            if req is self.chunked_req:
                self._event("chunk", req, f"chunk {req.num_chunks_done}: {len(req.fill_ids)}/{req.seqlen} tokens")
        new_batch.prefill_stats = {
            "log_input_tokens": adder.log_input_tokens,
            "log_hit_tokens": adder.log_hit_tokens,
            "running_bs": running_bs,
            "num_new_seqs": len(adder.can_run_list),
        }
        no_logprob = not (new_batch.return_logprob or self.running_batch.return_logprob)
        if self.is_mixed_chunk and not self.running_batch.is_empty() and no_logprob:
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty() and self._room_to_mix():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                batch_is_full = self.running_batch.batch_is_full
                self.running_batch = self._empty_batch()
                self.running_batch.batch_is_full = batch_is_full
        return new_batch

    def _room_to_mix(self) -> bool:
        """Can the decode rows ride in this prefill pass without taking KV the prefill needs?

        They get slots only from what is left after this pass and the chunked request's
        remaining prompt: that prompt was checked whole at admission but is charged one chunk
        at a time, while each decode row's next token was reserved as one token (no pages)
        and its later output only as an estimate scaled by new_token_ratio. Without room they wait for the prefill, as without mixing, and the decode
        step that follows retracts if it must.
        """
        P = self.page_size
        need = self.running_batch.new_tokens_required_next_decode()
        req = self.chunked_req
        if req is not None:  # pages its remaining prompt will still take
            need += new_page_slots(req.kv_committed_len, req.seqlen, P)
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        return free >= need

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        """Drop finished, make room for one token each (evict, then retract), decay the ratio (§1.6)."""
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            old_ratio = self.new_token_ratio
            by_priority = self.priority_order if self.server_args.retraction_policy == "priority" else None
            retracted, self.new_token_ratio = batch.retract_decode(by_priority)
            self.num_retracted_reqs_total += len(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_tokens_gained: %d, "
                "#new_token_ratio: %.4f -> %.4f",
                len(retracted),
                sum(r.seqlen - 1 for r in retracted),
                old_ratio,
                self.new_token_ratio,
            )
            for req in retracted:
                self._event("retract", req, f"output_len={len(req.output_ids)}")
                self._requeue_retracted(req)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if self.draft_worker is not None:
            drafts = self.draft_worker.propose(batch.reqs)
            # (no drafts, or no room for them: a plain decode step; drafts are only ever a bonus)
            if any(drafts) and batch.room_for_drafts(drafts):
                batch.prepare_for_verify(drafts)
                return batch
        batch.prepare_for_decode()
        return batch

    def run_batch(self, batch: ScheduleBatch) -> Union[GenerationBatchResult, EmbeddingBatchResult]:
        """Forward + sample: the sampled tokens (and logprobs), and the pass's prompt logprobs; for
        an embedding model, forward only: each request's embedding (SGLang's forward_batch_embedding)."""
        self.forward_ct += 1
        with self.trace_range("get_forward_batch"):
            forward_batch = batch.get_forward_batch(self.model_runner)
        # (SGLang's ModelRunner.forward dispatches to forward_decode / forward_extend, which runs mixed batches too)
        mode = batch.forward_mode
        can_run_cuda_graph = self.model_runner.can_run_cuda_graph(forward_batch)
        with self.trace_range("forward_decode" if mode.is_decode() else "forward_target_verify" if mode.is_target_verify() else "forward_extend"):
            logits_output = self.model_runner.forward(forward_batch)
        if not self.is_generation:
            return EmbeddingBatchResult(logits_output.embeddings)
        with self.trace_range("sample"):
            sampling_info = batch.get_sampling_info(
                self.model_config.vocab_size, self.model_runner.device, self.eos_token_ids
            )
            sampled = self.model_runner.sample(logits_output, sampling_info)
        if self.tp_group.world_size > 1:  # (the ranks compare it at each broadcast: a token sampled otherwise shows)
            self.token_checksum = fold_token_checksum(self.token_checksum, sampled.next_token_ids.tolist())
        row_reqs = batch.row_reqs()
        for row, message in (sampled.custom_logit_processor_errors or {}).items():
            # its processor failed: this request ends with the 400 (its token this step is dropped),
            # the rest of the batch goes on
            req = row_reqs[row]
            if req.to_finish is None and not req.finished():
                logger.warning("Request %s: %s", req.rid, message)
                req.to_finish = FINISH_ABORT(message, 400, "BadRequestError")
        return GenerationBatchResult(
            *sampled, input_logprobs=logits_output.input_logprobs, hidden_states=logits_output.hidden_states,
            can_run_cuda_graph=can_run_cuda_graph,
        )

    def self_check_during_idle(self) -> None:
        """Idle: reset the ratio and check that no KV slot leaked (§12.1), once per idle period.

        The process shells call it after a step's outputs are sent (event_loop_normal, just
        before it blocks on recv; Engine.step): SGLang's loop polls and runs it on an empty
        iteration, which a blocking loop never takes. After the outputs, because the check
        walks the whole tree: the last token of a burst must not wait for it.
        """
        if not self.is_idle() or self._idle_checked:
            return
        self._idle_checked = True
        self.new_token_ratio = self.init_new_token_ratio
        with self.trace_range("self_check_during_idle"):  # (it walks the whole radix tree)
            self.check_memory_when_idle()

    def check_memory_when_idle(self) -> None:
        """invariant: available + evictable + protected == total when idle, nothing protected."""
        self.tree_cache.check_integrity(total=self.max_total_num_tokens)
        if self.tree_cache.protected_size() != 0:
            raise RuntimeError(f"{self.tree_cache.protected_size()} tree tokens still locked when idle")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise RuntimeError("request row leak detected when idle")

    def check_integrity(self) -> None:
        """The same conservation law at any step: slots held by live requests outside the
        tree (their own pages past cache_protected_len) count as used."""
        P = self.page_size
        held = sum(
            ceil_paged_tokens(r.kv_committed_len, P) - r.cache_protected_len for r in self._reqs_holding_rows()
        )
        available = self.token_to_kv_pool_allocator.available_size() + held
        self.tree_cache.check_integrity(available_size=available, total=self.max_total_num_tokens)
        # The counts can balance while a row points at freed slots (its K/V would be read from
        # pages another request writes): every live row's committed slots must be allocated.
        for r in self._reqs_holding_rows():
            slots = self.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_committed_len]  # [committed]
            if len(slots) and bool(self.token_to_kv_pool_allocator.is_free(slots).any()):
                raise AssertionError(f"request {r.rid}: its req_to_token row points at freed KV slots")

    def _reqs_holding_rows(self) -> List[Req]:
        reqs: Dict[int, Req] = {}
        for batch in (self.running_batch, self.last_batch):
            for r in batch.reqs if batch is not None else []:
                if r.req_pool_idx is not None:
                    reqs[id(r)] = r
        if self.chunked_req is not None and self.chunked_req.req_pool_idx is not None:
            reqs[id(self.chunked_req)] = self.chunked_req
        return list(reqs.values())

# --------------------------------------------------------------------------- the process shell
def recv_requests(recv_from_tokenizer: Any, block: bool, timeout_s: Optional[float] = None) -> List[Any]:
    """Every message the TokenizerManager has queued (seed 002's first call of the loop).

    `block`: the scheduler is idle, so wait for the first one instead of spinning; for at most
    `timeout_s` when given (--tp-size N: rank 0 wakes to keep the other ranks' collectives alive),
    then return what there is, maybe nothing.
    """
    import zmq

    recv_reqs: List[Any] = []
    if block and (timeout_s is None or recv_from_tokenizer.poll(int(timeout_s * 1000))):
        recv_reqs.append(decode(recv_from_tokenizer.recv()))
    while True:
        try:
            recv_reqs.append(decode(recv_from_tokenizer.recv(zmq.NOBLOCK)))
        except zmq.ZMQError:
            return recv_reqs


def event_loop_normal(scheduler: Scheduler, recv_from_tokenizer: Any, send_to_detokenizer: Any,
                      send_to_tokenizer: Any, publish_snapshot: Any = None, tp_leader: Optional[TpLeader] = None) -> None:  # fmt: skip
    """recv_requests -> process -> one step (run_step: get_next_batch_to_run, run_batch) -> send; block on recv when idle.

    The soft watchdog logs an iteration slower than --soft-watchdog-timeout (with the
    rids being run); the hard one exits the process when one makes no progress for
    --watchdog-timeout. Time spent waiting for requests counts for neither.

    `tp_leader` (--tp-size N, rank 0): what was received goes to the other ranks first, which
    then run the same iteration (tp_lockstep.follower_loop); an idle wait ends after a
    heartbeat interval with nothing, and that empty iteration is broadcast too.
    """
    import zmq

    from minisgl.managers.watchdog import HardWatchdog, SoftWatchdog

    def describe() -> str:
        batch = scheduler.cur_batch
        return f"current batch rids: {[r.rid for r in batch.reqs] if batch is not None else []}"

    args = scheduler.server_args
    soft_watchdog = SoftWatchdog("Scheduler", args.soft_watchdog_timeout, describe)
    hard_watchdog = HardWatchdog("Scheduler", args.watchdog_timeout, describe)

    @contextlib.contextmanager
    def watchdogs_paused() -> Iterator[None]:
        with soft_watchdog.disable(), hard_watchdog.disable():
            yield

    scheduler.watchdogs_paused = watchdogs_paused  # (writing a long trace, reading an adapter: not a hung step)

    def send_outputs() -> None:
        outputs = scheduler.pop_outputs()
        if outputs:
            with scheduler.trace_range("send_to_detokenizer"):
                for out in outputs:
                    send_to_detokenizer.send(encode(out))

    while True:
        # (while profiling, an idle wait shows as one long recv_requests range)
        if scheduler.is_idle():
            with soft_watchdog.disable(), hard_watchdog.disable():  # waiting is not being stuck
                with scheduler.trace_range("recv_requests"):
                    heartbeat = tp_leader.heartbeat_s if tp_leader is not None else None
                    recv_reqs = recv_requests(recv_from_tokenizer, block=True, timeout_s=heartbeat)
        else:
            with scheduler.trace_range("recv_requests"):
                recv_reqs = recv_requests(recv_from_tokenizer, block=False)
        if tp_leader is not None:  # (SGLang's broadcast_pyobj of recv_reqs)
            with scheduler.trace_range("broadcast_recv_reqs"):
                tp_leader.broadcast(recv_reqs)
        for reply in scheduler.process_input_requests(recv_reqs):
            send_to_tokenizer.send(encode(reply))
        send_outputs()  # e.g. aborts of waiting requests
        batch = scheduler.run_step()
        send_outputs()
        for reply in scheduler.pop_control_replies():  # (an unload that waited for its requests)
            send_to_tokenizer.send(encode(reply))
        # Outputs are out; if that was the last work, the idle check (ratio reset, leak check)
        # runs now, before the snapshot, so the page shows what Engine.step() shows.
        scheduler.self_check_during_idle()
        # Publish when something changed: a batch ran, requests arrived or were aborted
        # (their events), or the cache was flushed. A control request alone (/get_load and
        # /metrics polling while idle) changes nothing: it would republish the same step.
        # (a weight update flushes too, and a held one runs at the end of a step)
        flushed = any(isinstance(m, (FlushCacheReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput))
                      for m in recv_reqs)  # fmt: skip
        changed = batch is not None or bool(scheduler.events) or flushed
        if publish_snapshot is not None and changed:
            with scheduler.trace_range("publish_snapshot"):
                msg = SchedulerSnapshotOut(scheduler.forward_ct, json.dumps(scheduler.snapshot()))
                # PUB never blocks: past its high-water mark a stalled viewer loses frames, not steps
                publish_snapshot.send(encode(msg), zmq.NOBLOCK)
        soft_watchdog.feed()
        hard_watchdog.feed()


def run_scheduler_process(server_args: ServerArgs, port_args: Any, pipe_writer: Any) -> None:
    """Child process entry: build ModelRunner + Scheduler, report ready, loop forever.

    With --tp-size N this is rank 0, the one with the sockets; ranks 1..N-1 run
    run_tp_follower_process (below) and follow its broadcasts."""
    import zmq

    from minisgl.distributed import init_tensor_parallel_group
    from minisgl.model_executor.model_runner import ModelRunner
    from minisgl.utils import configure_logging, get_tokenizer, get_zmq_socket, kill_itself_when_parent_died, leave_ctrl_c_to_the_parent

    kill_itself_when_parent_died()
    leave_ctrl_c_to_the_parent()
    tp_size = server_args.tp_size
    configure_logging(server_args.log_level, prefix="Scheduler" if tp_size == 1 else "Scheduler TP0")  # (SGLang's " TP0")
    # tqdm (the weight-loading bar) would otherwise create a multiprocessing lock, a
    # semaphore the parent's resource tracker reports as leaked when this child is stopped.
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    with start_up_reported(pipe_writer, "Scheduler" if tp_size == 1 else "Scheduler TP0"):
        tp_group, tp_leader = None, None
        if tp_size > 1:
            if server_args.device == "cpu":
                set_threads_per_rank(tp_size)
            tp_group = init_tensor_parallel_group(0, tp_size, port_args.tp_store_path, server_args.device, server_args.dist_timeout)
        model_runner = ModelRunner(server_args, tp_group=tp_group)
        tokenizer = get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        scheduler = Scheduler(server_args, model_runner, tokenizer)
        if tp_group is not None:
            tp_leader = TpLeader(tp_group, scheduler, heartbeat_interval(server_args.dist_timeout))
        context = zmq.Context(2)
        recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        send_to_detokenizer = get_zmq_socket(context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        send_to_tokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        publish = None
        if server_args.visualize:
            publish = get_zmq_socket(context, zmq.PUB, port_args.visualizer_ipc_name, bind=True)
            # PUB never blocks: past the high-water mark it drops. Keep room for a burst of
            # steps while the HTTP process is busy, so retract/finish events survive.
            publish.setsockopt(zmq.SNDHWM, 1024)
        pipe_writer.send(
            {
                "status": "ready",
                "max_total_num_tokens": scheduler.max_total_num_tokens,
                "context_len": scheduler.model_config.context_len,
                "vocab_size": scheduler.model_config.vocab_size,
                "max_req_input_len": scheduler.max_req_input_len,
                "default_sampling_params": scheduler.model_config.default_sampling_params,
                # what an embedding request's `dimensions` is checked against (tokenization.check_dimensions)
                "hidden_size": scheduler.model_config.hidden_size,
                "is_matryoshka": scheduler.model_config.is_matryoshka,
                "matryoshka_dimensions": scheduler.model_config.matryoshka_dimensions,
            }
        )
    try:
        event_loop_normal(scheduler, recv_from_tokenizer, send_to_detokenizer, send_to_tokenizer, publish, tp_leader)
    except Exception:
        logger.exception("Scheduler hit an exception")
        sys.exit(1)
    finally:  # (as a follower's end: exit 1, not an abort; a stop by SIGTERM never gets here)
        if tp_group is not None:
            tp_group.destroy()


def run_tp_follower_process(
    server_args: Any, tp_rank: int, store_path: str, pipe_writer: Any, num_threads: Optional[int] = None,
    engine_pid: Optional[int] = None, log_level: Optional[str] = None, torch_math: Optional[Dict[str, Any]] = None,
) -> None:  # fmt: skip
    """Entry of rank `tp_rank` > 0 (server or Engine): join the group, build ModelRunner and
    Scheduler, report ready on the pipe, then follow rank 0 until it says shutdown.

    `num_threads`: the Engine's per-rank count (its rank 0 is the user's process); the server's
    ranks each take threads_per_rank(torch's default). `engine_pid`: the Engine's process, which
    this rank must not outlive; None in the server, whose ranks die with the launcher.
    `log_level`: the Engine's (its "minisgl" logger's level); the server's ranks take --log-level.
    `torch_math`: the Engine's torch_math_settings(); the server's ranks all keep torch's defaults.
    The ready message carries the settings this rank runs with (the Engine compares them).
    """
    from minisgl.distributed import init_tensor_parallel_group
    from minisgl.model_executor.model_runner import ModelRunner
    from minisgl.utils import configure_logging, get_tokenizer, kill_itself_when_parent_died, leave_ctrl_c_to_the_parent

    if engine_pid is not None:
        exit_when_parent_exits(engine_pid)
    else:
        kill_itself_when_parent_died()
    leave_ctrl_c_to_the_parent()
    # (as run_scheduler_process: tqdm's default multiprocessing lock is a semaphore the parent's
    # resource tracker reports as leaked when this process is stopped)
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    configure_logging(log_level or server_args.log_level, prefix=f"Scheduler TP{tp_rank}")
    # rank 0 logs each step's line, and the warnings every rank has alike; the others would only repeat them
    logging.getLogger("minisgl.scheduler").setLevel(max(logging.WARNING, logging.getLogger().level))
    for handler in logging.getLogger().handlers:
        handler.addFilter(RankOwnWarningsOnly())
    with start_up_reported(pipe_writer, f"Scheduler TP{tp_rank}"):
        if torch_math is not None:
            apply_torch_math_settings(torch_math)
        if server_args.device == "cpu":
            set_threads_per_rank(server_args.tp_size, num_threads)
        group = init_tensor_parallel_group(tp_rank, server_args.tp_size, store_path, server_args.device, server_args.dist_timeout)
        model_runner = ModelRunner(server_args, show_progress=False, tp_group=group)
        scheduler = Scheduler(server_args, model_runner, get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code))
        pipe_writer.send({"status": "ready", "tp_rank": tp_rank, "torch_math": torch_math_settings()})
    try:
        follower_loop(scheduler, group, None if engine_pid is not None else server_args.watchdog_timeout)
    except Exception:
        logger.exception("Scheduler TP%d hit an exception", tp_rank)
        sys.exit(1)
    finally:  # (before the interpreter finalizes: a gloo thread still freeing a tensor then aborts it)
        group.destroy()
