"""SchedulerMetricsMixin (stage 3, observability). In: the scheduler's state after a step.
Out: SGLang-format log lines and the JSON snapshot (docs/snapshot.md).

Mixed into `Scheduler` (as in SGLang's scheduler_metrics_mixin.py): read-only views of
the scheduler's state. The visualizer, the ipywidgets twin and the notebooks use only
`snapshot()`; the log lines are the ones an SGLang user already knows how to read.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from minisgl.managers.schedule_batch import Req, ScheduleBatch, named_priority
from minisgl.mem_cache.namespace import key_tag
from minisgl.model_executor.forward_batch_info import ForwardMode

logger = logging.getLogger("minisgl.scheduler")


class SchedulerMetricsMixin:
    # ------------------------------------------------------------------ logs
    def _token_usage(self) -> tuple[int, float]:
        """Locked (protected) tree nodes count as used, as in SGLang."""
        num_used = self.max_total_num_tokens - (
            self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        )
        return num_used, num_used / self.max_total_num_tokens

    def _graph_label(self) -> str:
        return "cuda graph" if str(self.model_runner.device).startswith("cuda") else "cpu graph"

    def log_prefill_stats(self, batch: ScheduleBatch) -> None:
        stats = batch.prefill_stats
        if stats is None:
            return
        now = time.perf_counter()
        throughput = stats["log_input_tokens"] / max(now - self.last_prefill_log_time, 1e-9)
        self.last_prefill_log_time = now
        self.total_hit_tokens += stats["log_hit_tokens"]
        self.total_input_tokens += stats["log_input_tokens"]
        _, usage = self._token_usage()
        self.log_line = (
            f"Prefill batch, #new-seq: {stats['num_new_seqs']}, #new-token: {stats['log_input_tokens']}, "
            f"#cached-token: {stats['log_hit_tokens']}, token usage: {usage:.2f}, "
            f"#running-req: {stats['running_bs']}, #queue-req: {len(self.waiting_queue)}, "
            f"input throughput (token/s): {throughput:.2f}, {self._graph_label()}: False"
        )
        logger.info(self.log_line)

    def log_decode_stats(self, batch: ScheduleBatch, can_run_cuda_graph: bool) -> None:
        now = time.perf_counter()
        gen_throughput = self.num_generated_tokens / max(now - self.last_decode_log_time, 1e-9)
        self.last_decode_log_time, self.num_generated_tokens = now, 0
        self.last_gen_throughput = gen_throughput
        num_used, usage = self._token_usage()
        accept = ""
        if self.draft_worker is not None:
            # SGLang's accept len: tokens a request got per verify pass (accepted drafts + 1), since the last line
            rows, tokens = self.spec_num_verify_rows - self._spec_logged[0], self.spec_num_verify_tokens - self._spec_logged[1]
            accept = f"accept len: {tokens / rows if rows else 1.0:.2f}, "
            self._spec_logged = (self.spec_num_verify_rows, self.spec_num_verify_tokens)
        self.log_line = (
            f"Decode batch, #running-req: {batch.batch_size()}, #token: {num_used}, token usage: {usage:.2f}, {accept}"
            f"{self._graph_label()}: {can_run_cuda_graph}, gen throughput (token/s): {gen_throughput:.2f}, "
            f"#queue-req: {len(self.waiting_queue)}"
        )
        logger.info(self.log_line)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> Dict[str, Any]:
        """The scheduler's state after the last step, JSON-ready (schema: docs/snapshot.md)."""
        now = time.perf_counter()
        batch = self.cur_batch
        mode = batch.forward_mode.name if batch is not None else ForwardMode.IDLE.name
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        summary = self.tree_cache.summary(max_nodes=64)
        return {
            "step": self.forward_ct,
            "time": time.time(),
            "forward_mode": mode,
            "log_line": self.log_line,
            "waiting_queue": [
                {
                    "rid": r.rid,
                    "input_len": len(r.origin_input_ids),
                    "prefix_len": len(r.prefix_indices),
                    "output_len": len(r.output_ids),
                    "waited_ms": (now - r.time_stats.last_wait_queue_entry_time) * 1e3,
                    "retracted": r.is_retracted,
                    "retraction_count": r.retraction_count,
                    # --enable-priority-scheduling: the priority it named (None: none, or the flag is off)
                    "priority": named_priority(r.priority),
                    "lora_id": r.lora_id,  # --lora-paths: its adapter (None: the base model)
                    "cache_key": key_tag(r.cache_key),  # its extra_key / cache_salt, as a tag (docs/snapshot.md)
                }
                for r in self.waiting_queue
            ],
            # requests whose grammar (structured output) is still compiling: not yet waiting
            "grammar_queue": [
                {"rid": r.rid, "grammar": r.sampling_params.grammar_key[0], "waited_ms": (now - r.time_stats.scheduler_recv_time) * 1e3}
                for r in self.grammar_queue
            ],
            "chunked_req": self._chunked_req_snapshot(),
            "batch": None if batch is None else {"forward_mode": mode, "reqs": self._batch_reqs_snapshot(batch)},
            "running_batch": [
                {"rid": r.rid, "input_len": len(r.origin_input_ids), "output_len": len(r.output_ids),
                 "max_new_tokens": r.sampling_params.max_new_tokens,
                 "lora_id": r.lora_id,  # --lora-paths: its adapter (None: the base model)
                 "cache_key": key_tag(r.cache_key)}  # its extra_key / cache_salt, as a tag
                for r in self._decoding_reqs()
            ],  # fmt: skip
            "adder": self.adder_record,
            "memory": {
                "total": self.max_total_num_tokens,
                "available": available,
                "evictable": evictable,
                "protected": protected,
                "used": self.max_total_num_tokens - available - evictable,
                "page_size": self.page_size,
                "req_slots_total": self.req_to_token_pool.size,
                "req_slots_free": self.req_to_token_pool.available_size(),
            },
            "radix": summary,
            "new_token_ratio": self.new_token_ratio,
            "speculative": self._speculative_snapshot(),
            "events": list(self.events),
            "finished": list(self.finished_records),
        }

    def _num_chunks(self, req: Req, chunked_req: Optional[Req]) -> int:
        """Chunks of the current prefill round: done so far + what the rest still needs at the
        chunk the next pass gets (an estimate: a batch that shares the budget gets less).

        `chunked_req`: the request left mid-prompt when this was decided (a batch's own, so an
        abort after the step does not rewrite that step's row as a whole prefill)."""
        remaining = req.seqlen - len(req.fill_ids) if req is chunked_req else 0
        size = self.chunked_prefill_size or max(remaining, 1)
        if self.is_mixed_chunk:  # each decoding request rides in the next chunk and takes a token of its budget
            size = max(size - len(self._decoding_reqs()), 1)
        return req.num_chunks_done + -(-remaining // size)

    def _chunked_req_snapshot(self) -> Optional[Dict[str, Any]]:
        req = self.chunked_req
        if req is None:
            return None
        return {"rid": req.rid, "done_tokens": len(req.fill_ids), "total_tokens": req.seqlen,
                "chunk_index": req.num_chunks_done, "num_chunks": self._num_chunks(req, req)}  # fmt: skip

    def _speculative_snapshot(self) -> Optional[Dict[str, Any]]:
        """--speculative-algorithm: the running totals since start (None when it is off): the request
        rows of every decoding pass (decode or verify) and the tokens they gave. The accept length is
        the decode log line's (tokens per request per decoding pass), over the whole run."""
        if self.draft_worker is None:
            return None
        rows, tokens = self.spec_num_verify_rows, self.spec_num_verify_tokens
        return {
            "algorithm": self.server_args.speculative_algorithm,
            "num_draft_tokens": self.server_args.speculative_num_draft_tokens,
            "decode_rows": rows,
            "decode_tokens": tokens,
            "accept_length": tokens / rows if rows else None,  # (no decoding pass yet: nothing to divide)
        }

    def _batch_reqs_snapshot(self, batch: ScheduleBatch) -> List[Dict[str, Any]]:
        decoding = {id(r) for r in batch.decoding_reqs or []}
        verify = batch.forward_mode.is_target_verify()
        out = []
        for i, r in enumerate(batch.reqs):
            is_decode = batch.forward_mode.is_decode() or verify or id(r) in decoding
            out.append(
                {
                    "rid": r.rid,
                    "extend_len": batch.extend_lens[i] if i < len(batch.extend_lens) else 1,
                    "prefix_len": batch.prefix_lens[i] if i < len(batch.prefix_lens) else 0,
                    # the radix hit within prefix_len (a decode row's context is its own, not a hit)
                    "cached_len": 0 if is_decode else r.prefix_hit_len,
                    "is_chunked": r.is_chunked,
                    "chunk_index": 0 if is_decode else r.num_chunks_done,
                    "num_chunks": 0 if is_decode else self._num_chunks(r, batch.chunked_req),
                    "is_decode": is_decode,
                    # (an embedding request's dummy token, SGLang's way to finish it, is not an output)
                    "output_len": len(r.output_ids) if self.is_generation else 0,
                    "max_new_tokens": r.sampling_params.max_new_tokens,
                    # a verify pass (speculative decoding): the drafts the row carried after its last
                    # token, and how many of them the request took (0 in every other mode)
                    "draft_len": len(batch.draft_token_ids[i]) if verify and i < len(batch.draft_token_ids) else 0,
                    "accepted_len": batch.accepted_draft_lens[i] if verify and i < len(batch.accepted_draft_lens) else 0,
                    "lora_id": r.lora_id,  # --lora-paths: the adapter its rows ran with (None: the base model)
                    "cache_key": key_tag(r.cache_key),  # its extra_key / cache_salt, as a tag
                }
            )
        return out

    def _decoding_reqs(self) -> List[Req]:
        """Requests that will decode next: the running batch plus the just-prefilled ones."""
        # (the chunked request prefills next; a max_new_tokens=0 request never decodes)
        return [r for r in self._unfinished_reqs() if r is not self.chunked_req and r.sampling_params.max_new_tokens > 0]
