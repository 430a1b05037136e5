"""SchedulerOutputProcessorMixin (stage 3, after the forward). In: a ScheduleBatch and its
GenerationBatchResult (the sampler's output, the prompt logprobs), or an embedding model's
EmbeddingBatchResult. Out: BatchTokenIDOutput (BatchEmbeddingOutput) for the detokenizer.

Mixed into `Scheduler` (as in SGLang's scheduler_output_processor_mixin.py): it reads and
writes the scheduler's state (tree_cache, req_to_token_pool, chunked_req, _outputs, ...).
For every request of the batch it appends the sampled token, checks whether the request
finished, hands a finished request's KV to the radix cache and frees its row, caches a
prefilled request that keeps running (`cache_unfinished_req`), and decides who emits
output this step (`stream_output`). An embedding request (--is-embedding) takes SGLang's embedding
branch: its last chunk's row is its embedding, a dummy token 0 finishes it (max_new_tokens 0),
and it leaves in one BatchEmbeddingOutput (`stream_output_embedding`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from minisgl.layers.logits_processor import InputLogprobs
from minisgl.managers.io_struct import BatchEmbeddingOutput, BatchTokenIDOutput, HiddenStateRows
from minisgl.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch, release_kv_cache
from minisgl.speculative.ngram_worker import NGRAMWorker

# a non-streaming request still emits every 50 tokens, keeping the detokenizer incremental
DEFAULT_FORCE_STREAM_INTERVAL = 50


class GenerationBatchResult(NamedTuple):
    """Scheduler.run_batch's result (SGLang's name): the Sampler's SampleOutput fields, then
    the pass's prompt logprobs (LogitsProcessorOutput.input_logprobs)."""

    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: Optional[torch.Tensor]  # [bs] float32, None when no request asked
    top_logprobs_val: Optional[List[List[float]]]
    top_logprobs_idx: Optional[List[List[int]]]
    token_ids_logprobs: Optional[List[Optional[List[float]]]] = None  # per request, at its token_ids_logprob
    custom_logit_processor_errors: Optional[Dict[int, str]] = None  # (run_batch turned them into to_finish)
    input_logprobs: Optional[InputLogprobs] = None  # rows in ScheduleBatch.input_logprob_rows order
    # [N, H]: every token's final-norm hidden state, in input_ids order (LogitsProcessorOutput.hidden_states);
    # None unless a request of the batch asked for return_hidden_states
    hidden_states: Optional[torch.Tensor] = None
    can_run_cuda_graph: bool = False  # the pass replayed a captured CUDA graph (the decode log line says so)


class EmbeddingBatchResult(NamedTuple):
    """Scheduler.run_batch's result for an embedding model (SGLang's name): the Pooler's rows."""

    embeddings: Union[torch.Tensor, List[torch.Tensor]]  # [bs, H] float32, or one [d_i] row per request


class SchedulerOutputProcessorMixin:
    # False for an embedding model's scheduler (--is-embedding; Scheduler.__init__ sets its own)
    is_generation: bool = True
    # --speculative-algorithm NGRAM: the scheduler's NGRAMWorker (None: every decoding pass is a plain decode step)
    draft_worker: Any = None

    # ------------------------------------------------------------------ results
    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        if batch.forward_mode.is_decode() or batch.forward_mode.is_target_verify():
            self.process_batch_result_decode(batch, result)
        elif batch.forward_mode.is_extend():
            self.process_batch_result_prefill(batch, result)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: Any) -> None:
        """Append the first token (unless mid-chunk), finish or cache the prompt, stream (§6.8)."""
        if not self.is_generation:
            self.process_batch_result_embedding(batch, result)
            return
        next_token_ids = result.next_token_ids.tolist()
        logprobs = _logprob_lists(result)
        input_logprobs = _input_logprob_rows(batch, result.input_logprobs)
        _store_hidden_states(batch, result.hidden_states)
        decoding = {id(r) for r in batch.decoding_reqs or []}
        skip_stream_req: Optional[Req] = None
        for i, (req, token) in enumerate(zip(batch.reqs, next_token_ids)):
            # SGLang's guard; is_retracted matters only under its overlap scheduler (a request
            # retracted while its forward ran). Here a retracted request has left the batch.
            if req.finished() or req.is_retracted:
                continue
            if input_logprobs[i] is not None:
                req.add_input_logprobs(*input_logprobs[i])
            if req.is_chunked > 0:
                # a non-final chunk: its sampled token is meaningless, nothing streams
                req.is_chunked -= 1
                skip_stream_req = req
                continue
            if not req.time_stats.prefill_finished_time:
                req.time_stats.prefill_finished_time = time.perf_counter()
                if id(req) not in decoding:
                    self._event("prefill_done", req, f"cached_tokens={req.cached_tokens}")
            req.finish_input_logprobs()
            req.output_ids.append(int(token))
            self._append_logprobs(req, logprobs, i)
            self._advance_grammar(req)
            req.check_finished()
            if req.finished():
                self._release_finished(req)
            elif id(req) not in decoding:
                # the prompt enters the tree now, locked while the request runs
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output(batch.reqs, skip_stream_req)
        self.log_prefill_stats(batch)

    def process_batch_result_embedding(self, batch: ScheduleBatch, result: EmbeddingBatchResult) -> None:
        """SGLang's embedding branch of process_batch_result_prefill: a request whose prompt is
        done takes its row as its embedding and finishes (the dummy output token 0 meets
        max_new_tokens 0; the to_finish of an abort wins, as for any request); its whole prompt
        goes into the radix tree like any finished request's, so a later prompt that shares a
        prefix computes only the rest. A non-final chunk's row is not the prompt's last token:
        dropped."""
        rows = result.embeddings
        embeddings = rows.tolist() if torch.is_tensor(rows) else [row.tolist() for row in rows]  # one transfer each
        skip_stream_req: Optional[Req] = None
        for req, embedding in zip(batch.reqs, embeddings):
            if req.finished():  # (an embedding server has no decoding requests, nor retracts)
                continue
            if req.is_chunked > 0:
                req.is_chunked -= 1
                skip_stream_req = req
                continue
            req.time_stats.prefill_finished_time = time.perf_counter()
            self._event("prefill_done", req, f"cached_tokens={req.cached_tokens}")
            req.output_ids.append(0)
            req.check_finished()
            assert req.finished(), "an embedding request finishes with its prefill (max_new_tokens 0)"
            if not isinstance(req.finished_reason, FINISH_ABORT):  # (an aborted one's row is not its answer)
                req.embedding = embedding
            self._release_finished(req)
        self.stream_output(batch.reqs, skip_stream_req)
        self.log_prefill_stats(batch)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: Any) -> None:
        """Append each request's token, finish or go on (§6.8). A verify pass (speculative decoding)
        has a row per token of each request: the request takes the tokens its rows sampled up to
        the first one that is not its next draft (that one included), one at a time, exactly as
        that many decode steps would (each checked for a stop), and gives back the K/V slots of
        what it did not take."""
        next_token_ids = result.next_token_ids.tolist()
        logprobs = _logprob_lists(result)
        verify = batch.forward_mode.is_target_verify()
        if not verify:
            _store_hidden_states(batch, result.hidden_states)
        self.token_to_kv_pool_allocator.free_group_begin()
        num_tokens = 0
        row = 0
        if verify:  # (known only in this loop; the snapshot's accepted_len reads it; 0: a row it skips)
            batch.accepted_draft_lens = [0] * len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            first = row
            row += batch.extend_lens[i] if verify else 1
            if req.finished() or req.is_retracted:
                continue
            tokens, before = next_token_ids[first:row], len(req.output_ids)
            if verify:
                drafts = batch.draft_token_ids[i]
                num_accepted = NGRAMWorker.accepted(drafts, tokens)
                self.draft_worker.record(req, len(drafts), num_accepted)
                tokens = tokens[: num_accepted + 1]
            for j, token in enumerate(tokens):
                if verify and result.hidden_states is not None and req.return_hidden_states:
                    _store_hidden_row(req, batch.prefix_lens[i] + j, result.hidden_states[first + j])
                req.output_ids.append(int(token))
                self._append_logprobs(req, logprobs, first + j)
                self._advance_grammar(req)
                req.check_finished()
                num_tokens += 1
                if req.finished():
                    break
            if verify:
                batch.release_unaccepted(req, batch.prefix_lens[i] + len(req.output_ids) - before)
                # (for the snapshot: the drafts it took, the bonus token aside; fewer when a stop cut them)
                batch.accepted_draft_lens[i] = len(req.output_ids) - before - 1
            if self.draft_worker is not None:  # (every decoding pass counts, as in SGLang, where each one verifies)
                req.spec_verify_ct += 1
                self.spec_num_verify_rows += 1
                self.spec_num_verify_tokens += len(req.output_ids) - before
            if req.finished():
                self._release_finished(req)
        self.stream_output(batch.reqs)
        self.token_to_kv_pool_allocator.free_group_end()
        self.forward_ct_decode += 1
        self.num_generated_tokens += num_tokens
        if self.forward_ct_decode % self.server_args.decode_log_interval == 0:
            self.log_decode_stats(batch, result.can_run_cuda_graph)

    def _append_logprobs(self, req: Req, logprobs: Tuple[Any, Any, Any, Any], i: int) -> None:
        token_lps, top_vals, top_idxs, token_ids_lps = logprobs
        if not req.return_logprob or token_lps is None:
            return
        req.output_token_logprobs_val.append(float(token_lps[i]))
        req.output_token_logprobs_idx.append(req.output_ids[-1])
        if req.top_logprobs_num > 0 and top_vals is not None:
            req.output_top_logprobs_val.append([float(v) for v in top_vals[i]])
            req.output_top_logprobs_idx.append([int(v) for v in top_idxs[i]])
        if req.token_ids_logprob and token_ids_lps is not None:
            req.output_token_ids_logprobs_val.append([float(v) for v in token_ids_lps[i]])
            req.output_token_ids_logprobs_idx.append(list(req.token_ids_logprob))

    @staticmethod
    def _advance_grammar(req: Req) -> None:
        """Feed the token just appended to the request's grammar, before check_finished reads
        whether the grammar ended. A token the grammar refuses (the mask left no token: either
        min_new_tokens held back the stop token the finished output needed, or the grammar
        allows none there, as `root ::= root` never does) aborts the request without it."""
        if req.grammar is None or req.to_finish is not None:
            return
        try:
            req.grammar.accept_token(req.output_ids[-1])
        except ValueError:
            # (not the token's id: with every token masked, the sampler's pick among -inf logits is
            # arbitrary, and named a different id alone than beside another request)
            held_back = len(req.output_ids) <= req.sampling_params.min_new_tokens
            why = "min_new_tokens held back the stop token the finished output needed" if held_back else "the grammar allows no token here"
            if req.custom_logit_processor_instance is not None:  # (it runs after the grammar's mask, and may undo it)
                message = (
                    "Structured output stopped: the sampled token is outside the grammar (the request's custom logit "
                    f"processor runs after the grammar's mask and may have given a masked token a finite logit; or {why})"
                )
            else:
                message = f"Structured output stopped: no token continues the output inside its grammar ({why})"
            req.to_finish = FINISH_ABORT(message)

    def _release_finished(self, req: Req, detail: Optional[str] = None) -> None:
        """Finished: KV of origin + output[:-1] goes into the tree, the row is freed; one
        finish or abort event (detail: the finish reason, unless the caller says more)."""
        release_kv_cache(req, self.tree_cache, self.req_to_token_pool)
        req.time_stats.completion_time = time.perf_counter()
        finish = req.finished_reason.to_json()
        self._event("abort" if finish["type"] == "abort" else "finish", req, detail or json.dumps(finish))
        self._record_finished(req)

    def _record_finished(self, req: Req) -> None:
        self.finished_records.append(
            {
                "rid": req.rid,
                "finish_reason": req.finished_reason.to_json(),
                "output_len": len(req.output_ids_through_stop),
                **req.time_stats.to_ms_dict(),
            }
        )

    # ------------------------------------------------------------------ streaming
    def _should_stream(self, req: Req) -> bool:
        if req.finished():
            return not req.finished_output
        n = len(req.output_ids)
        # due when the output passed a send point since the last check (_reached): a verify pass
        # (speculative decoding) adds several tokens at once and may step over one
        before, req.stream_checked_len = req.stream_checked_len, n
        if n == 0:
            return False
        if req.stream:
            interval = req.sampling_params.stream_interval or self.server_args.stream_interval
            # (SGLang's: the 1st, (k + 1)-th, (2k + 1)-th ... token with an interval k > 1, every one with 1)
            due = _reached(before, n, interval, 1 if interval > 1 else 0)
            # hold back while the tail could still become a stop string
            return due and not req.check_match_stop_str_prefix()
        return _reached(before, n, DEFAULT_FORCE_STREAM_INTERVAL, 0)

    def stream_output(self, reqs: List[Req], skip_req: Optional[Req] = None) -> None:
        """Collect one BatchTokenIDOutput for every request that emits this step (an embedding
        model: stream_output_embedding)."""
        if not self.is_generation:
            self.stream_output_embedding(reqs)
            return
        emitting = [r for r in reqs if r is not skip_req and self._should_stream(r)]
        if not emitting:
            return
        # the logprob lists stay empty (not a list of empties per request) when no one asks:
        # they cross two process boundaries with every token (logprobs_of reads a short list as none)
        with_logprobs = any(r.return_logprob for r in emitting)
        with_hidden_states = any(r.return_hidden_states for r in emitting)  # (the same rule as the logprob lists)
        out = BatchTokenIDOutput(
            rids=[], finished_reasons=[], decode_ids=[], read_offsets=[], output_ids=[], skip_special_tokens=[],
            spaces_between_special_tokens=[], no_stop_trim=[], stop_strs=[], stop_regexes=[], prompt_tokens=[],
            completion_tokens=[], cached_tokens=[],
        )  # fmt: skip
        for req in emitting:
            if req.finished():
                req.finished_output = True
            decode_ids, read_offset = req.init_incremental_detokenize()
            through_stop = req.output_ids_through_stop
            start, end = req.send_token_offset, len(through_stop)
            params = req.sampling_params
            out.rids.append(req.rid)
            out.finished_reasons.append(req.finished_reason.to_json() if req.finished() else None)
            out.decode_ids.append(list(decode_ids[req.send_decode_id_offset :]))
            out.read_offsets.append(read_offset)
            out.output_ids.append(list(through_stop[start:end]))
            out.skip_special_tokens.append(params.skip_special_tokens)
            out.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
            out.no_stop_trim.append(params.no_stop_trim)
            out.stop_strs.append(list(params.stop_strs))
            out.stop_regexes.append(list(params.stop_regex_strs))
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(through_stop))
            out.cached_tokens.append(req.cached_tokens)
            if with_logprobs:
                _add_logprobs(out, req, start, end)
            if with_hidden_states:
                # the entries added since its last output, as float32 rows (raw bytes on the wire): the
                # prompt's rows come with its first one
                out.output_hidden_states.append(_unsent_hidden_states(req) if req.return_hidden_states else None)
            out.time_stats.append(req.time_stats.to_ms_dict())
            if self.draft_worker is not None:
                out.spec_verify_ct.append(req.spec_verify_ct)
            req.send_decode_id_offset = len(decode_ids)
            req.send_token_offset = end
        self._outputs.append(out)

    def stream_output_embedding(self, reqs: List[Req]) -> None:
        """One BatchEmbeddingOutput for the requests that finished this step and were not sent yet
        (SGLang's stream_output_embedding): an embedding has no partial result to stream."""
        done = [r for r in reqs if r.finished() and not r.finished_output]
        if not done:
            return
        for req in done:
            req.finished_output = True
        self._outputs.append(
            BatchEmbeddingOutput(
                rids=[r.rid for r in done],
                finished_reasons=[r.finished_reason.to_json() for r in done],
                embeddings=[r.embedding for r in done],
                prompt_tokens=[len(r.origin_input_ids) for r in done],
                cached_tokens=[r.cached_tokens for r in done],
                time_stats=[r.time_stats.to_ms_dict() for r in done],
            )
        )


def _reached(before: int, now: int, interval: int, remainder: int) -> bool:
    """Whether a length m with m % interval == remainder lies in (before, now]."""
    return (now - remainder) // interval > (before - remainder) // interval


def _add_logprobs(out: BatchTokenIDOutput, req: Req, start: int, end: int) -> None:
    """Request req's logprobs of output tokens [start, end) into out (one entry per list, in
    request order), and its prompt logprobs once, with its first output after the prefill."""
    out.output_token_logprobs_val.append(req.output_token_logprobs_val[start:end])
    out.output_token_logprobs_idx.append(req.output_token_logprobs_idx[start:end])
    out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:end])
    out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:end])
    out.output_token_ids_logprobs_val.append(req.output_token_ids_logprobs_val[start:end])
    out.output_token_ids_logprobs_idx.append(req.output_token_ids_logprobs_idx[start:end])
    send_input = req.input_logprobs_done and not req.input_logprobs_sent
    req.input_logprobs_sent = req.input_logprobs_sent or send_input
    out.input_token_logprobs_val.append(req.input_token_logprobs_val if send_input else [])
    out.input_token_logprobs_idx.append(req.input_token_logprobs_idx if send_input else [])
    out.input_top_logprobs_val.append(req.input_top_logprobs_val if send_input else [])
    out.input_top_logprobs_idx.append(req.input_top_logprobs_idx if send_input else [])
    out.input_token_ids_logprobs_val.append(req.input_token_ids_logprobs_val if send_input else [])
    out.input_token_ids_logprobs_idx.append(req.input_token_ids_logprobs_idx if send_input else [])


def _store_hidden_row(req: Req, position: int, row: torch.Tensor) -> None:
    """A verify pass's row [H] of one token the request took (a decode step's single row), kept as
    _store_hidden_states keeps rows: a float32 copy on the CPU."""
    req.add_hidden_states(position, row[None].to(device="cpu", dtype=torch.float32, copy=True).numpy())


def _store_hidden_states(batch: ScheduleBatch, hidden_states: Optional[torch.Tensor]) -> None:
    """Each asking request's rows of the pass into Req.hidden_states (SGLang does this in its
    prefill and decode result loops). Row order is input_ids': request i has extend_lens[i] rows
    (1 in a decode pass, and for a decode request riding a mixed pass), for positions from
    prefix_lens[i] on. Only the asking requests' rows leave the device, one transfer each, as
    float32 (exact for bfloat16 values): they stay raw until the HTTP process writes the answer."""
    if hidden_states is None:
        return
    start = 0
    for req, prefix_len, count in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        # (SGLang's guard too: a request finished meanwhile, an abort that came in this step, keeps what it has)
        if req.return_hidden_states and not req.finished():
            # a copy of its own (copy=True: on the CPU a view would keep the pass's [N, H] alive)
            rows = hidden_states[start : start + count].to(device="cpu", dtype=torch.float32, copy=True)  # [count, H]
            req.add_hidden_states(prefix_len, rows.numpy())
        start += count


def _unsent_hidden_states(req: Req) -> HiddenStateRows:
    """The entries of req.hidden_states added since its last output, as one HiddenStateRows (the
    prompt's entry, a list of per-chunk [k, H] blocks, first if it is among them), and marked sent:
    the scheduler keeps no row it sent (a 2,000-token prompt at H = 1,024 is 8 MB even as float32);
    the entries stay as None, since positions and counts are read from the list's length."""
    new = req.hidden_states[req.send_hidden_states_offset :]
    for k in range(req.send_hidden_states_offset, len(req.hidden_states)):
        req.hidden_states[k] = None
    req.send_hidden_states_offset = len(req.hidden_states)
    if not new:
        return HiddenStateRows.empty()
    prompt_blocks: List[np.ndarray] = new[0] if isinstance(new[0], list) else []
    steps = new[1:] if isinstance(new[0], list) else new  # [H] each
    rows = np.concatenate([*prompt_blocks, *(row[None, :] for row in steps)])  # [prompt rows + steps, H]
    return HiddenStateRows(rows, sum(len(block) for block in prompt_blocks))


def _logprob_lists(result: Any) -> Tuple[Any, Any, Any, Any]:
    """The batch's logprobs as Python lists, one transfer each (read per request, a GPU tensor
    cost a device sync per element): token logprobs [bs], top-k values and ids [bs][k], the
    named ids' logprobs [bs][T] (None rows for requests that name none)."""

    def as_list(x: Any) -> Any:
        if x is None:
            return None
        if torch.is_tensor(x):
            return x.tolist()
        return [v.tolist() if torch.is_tensor(v) else v for v in x]

    return (
        as_list(result.next_token_logprobs), as_list(result.top_logprobs_val), as_list(result.top_logprobs_idx),
        result.token_ids_logprobs,  # (already lists: the sampler read a few ids per row)
    )  # fmt: skip


def _input_logprob_rows(batch: ScheduleBatch, input_logprobs: Optional[InputLogprobs]) -> List[Optional[Tuple[Any, Any, Any, Any]]]:
    """Per request of the batch: its rows of the pass's prompt logprobs as Python lists
    (token logprobs, top-k values, top-k ids, named ids' values), or None when it has none."""
    out: List[Optional[Tuple[Any, Any, Any, Any]]] = [None] * len(batch.reqs)
    if input_logprobs is None:
        return out

    def as_list(x: Optional[torch.Tensor]) -> Optional[List[Any]]:
        return x.tolist() if x is not None else None  # one transfer each, as _logprob_lists

    values = input_logprobs.token_logprobs.tolist()
    columns = [as_list(input_logprobs.top_val), as_list(input_logprobs.top_idx), as_list(input_logprobs.token_ids_val)]
    start = 0
    for i, count in enumerate(batch.input_logprob_counts):
        if count > 0:
            end = start + count
            top_val, top_idx, named = (c[start:end] if c is not None else None for c in columns)
            out[i] = (values[start:end], top_val, top_idx, named)
            start = end
    return out
