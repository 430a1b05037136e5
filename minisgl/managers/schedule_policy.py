"""SchedulePolicy and PrefillAdder: who is admitted to the next prefill (sglang-facts.md §2, §3).

Where it sits: `Scheduler.get_new_batch_prefill` sorts the waiting queue with
`SchedulePolicy.calc_priority`, then offers requests one by one to a fresh
`PrefillAdder`, which checks them against five budgets and returns an AddReqResult:

    rem_total_tokens   KV space: available + evictable - offset (admitted extends, their
                       clipped max_new_tokens, and the running batch's remaining tokens
                       scaled by new_token_ratio)                         -> NO_TOKEN
    rem_input_tokens   compute per batch (max_prefill_tokens)             -> OTHER
    rem_chunk_tokens   fairness per forward (chunked_prefill_size)        -> truncate, OTHER
    prefill_max_requests   requests per prefill batch                     -> OTHER
    request slots      checked by the scheduler loop (batch_is_full)      -> BATCH_FULL
The scheduler stops at the first non-CONTINUE answer (head-of-line blocking, by design).
The adder records why it stopped and its budgets at that moment (`record()`), so a
snapshot can explain every admission decision.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

from minisgl.managers.schedule_batch import CLIP_MAX_NEW_TOKENS, Req, ScheduleBatch
from minisgl.mem_cache.allocator import ceil_paged_tokens
from minisgl.server_args import SCHEDULE_POLICIES

logger = logging.getLogger("minisgl.scheduler")

# the policies that order by radix-tree matches (SGLang's CacheAwarePolicy); the rest are CacheAgnosticPolicy
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
# lpm degrades to fcfs above this many waiting requests (matching them all costs too much)
LPM_FALLBACK_QUEUE_LEN = 128
# in-batch prefix caching thresholds (SGLang env defaults)
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # admitted (or nothing hit a limit): keep scanning the queue
    NO_TOKEN = enum.auto()  # out of KV memory: the running batch is full
    OTHER = enum.auto()  # any other limit: stop this pass


class PrefillAdder:
    """One prefill pass's admission: budgets, the admitted list, and why it stopped."""

    def __init__(
        self,
        page_size: int,
        tree_cache: Any,
        token_to_kv_pool_allocator: Any,
        running_batch: ScheduleBatch,
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: Optional[int],
        mixed_with_decode_tokens: int = 0,
        prefill_max_requests: Optional[int] = None,
    ) -> None:
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.running_batch = running_batch
        self.new_token_ratio = new_token_ratio
        self.max_prefill_tokens = rem_input_tokens
        self.chunked_prefill_size = rem_chunk_tokens
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if rem_chunk_tokens is None else rem_chunk_tokens - mixed_with_decode_tokens
        self.prefill_max_requests = prefill_max_requests
        self.rem_total_token_offset = mixed_with_decode_tokens
        self.cur_rem_token_offset = mixed_with_decode_tokens
        self.decode_row_tokens = 1 if mixed_with_decode_tokens else 0  # what each running request's ride costs the budgets
        self.can_run_list: List[Req] = []
        self.preempt_list: List[Req] = []  # running requests sent back to the queue (priority preemption)
        self.new_chunked_req: Optional[Req] = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        # the explanation record (STYLE.md habit 8)
        self.stop_reason: Optional[str] = None
        self.stop_detail = ""
        self.budgets_at_stop: Optional[Dict[str, Any]] = None
        # Running requests will still grow: reserve their remaining output, scaled by
        # new_token_ratio (an estimate of how much of max_new_tokens is really used).
        self.rem_total_token_offset += sum(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * new_token_ratio
            for r in running_batch.reqs
        )

    # ------------------------------------------------------------------ budgets
    @property
    def rem_total_tokens(self) -> float:
        return self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        return self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() - self.cur_rem_token_offset

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return self._stop(AddReqResult.NO_TOKEN, "KV cache budget exhausted (rem_total_tokens <= 0)")
        if self.rem_input_tokens <= 0:
            return self._stop(AddReqResult.OTHER, "rem_input_tokens exhausted (max_prefill_tokens)")
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return self._stop(AddReqResult.OTHER, "rem_chunk_tokens exhausted (chunked_prefill_size)")
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = ceil_paged_tokens(extend_input_len, self.page_size)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    # ------------------------------------------------------------------ the record
    def budgets(self) -> Dict[str, Any]:
        return {
            "rem_total_tokens": int(self.rem_total_tokens),
            "rem_input_tokens": int(self.rem_input_tokens),
            "rem_chunk_tokens": None if self.rem_chunk_tokens is None else int(self.rem_chunk_tokens),
            "max_prefill_tokens": self.max_prefill_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "prefill_max_requests": self.prefill_max_requests,
            "num_admitted": len(self.can_run_list),
        }

    def _stop(self, result: AddReqResult, detail: str) -> AddReqResult:
        self.record_stop(result.name, detail)
        return result

    def record_stop(self, reason: str, detail: str, replace: bool = False) -> None:
        """Remember the first limit hit this pass (and the budgets at that moment)."""
        if self.stop_reason is None or replace:
            self.stop_reason, self.stop_detail, self.budgets_at_stop = reason, detail, self.budgets()

    def record(self) -> Dict[str, Any]:
        return {
            "stop_reason": self.stop_reason,
            "stop_detail": self.stop_detail,
            "budgets": self.budgets_at_stop or self.budgets(),
            "admitted": [r.rid for r in self.can_run_list],
        }

    # ------------------------------------------------------------------ admission
    @contextlib.contextmanager
    def lock_node(self, last_node: Any) -> Iterator[None]:
        """Temporarily protect the request's own matched prefix, so evictable_size is honest."""
        self.tree_cache.inc_lock_ref(last_node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(last_node)

    def add_chunked_req(self, req: Req) -> Optional[Req]:
        """Continue the request mid-chunk; it always progresses. Returns it if still truncated."""
        _rem_tokens = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if _rem_tokens <= 0:
            # never stall a chunked request: it holds KV that only progress releases
            _rem_tokens = self.rem_chunk_tokens
        truncated = req.extend_input_len > _rem_tokens
        req.set_extend_input_len(min(req.extend_input_len, _rem_tokens))
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_prefill_budget(
            0, req.extend_input_len, 0 if truncated else min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        )
        return req if truncated else None

    def _reservation(self, r: Req) -> float:
        """What the budget holds back for running request `r`'s remaining output."""
        return min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _unlocked_by(self, r: Req, locks: Dict[int, int]) -> int:
        """Tokens of `r`'s tree prefix that become evictable when it lets go (with those in `locks`)."""
        if getattr(self.tree_cache, "disable", False) or r.last_node is None:
            return 0
        freed, node = 0, r.last_node
        while node is not None and node is not self.tree_cache.root_node:
            locks[id(node)] = locks.get(id(node), node.lock_ref) - 1
            if locks[id(node)] == 0:
                freed += len(node.key)
            node = node.parent
        return freed

    def preempt_to_schedule(self, req: Req, threshold: int, order: int, need_slot: bool) -> bool:
        """Priority preemption (SGLang's preempt_to_schedule, §2.8): make room for `req` by sending
        running requests back to the queue, each less important than `req` by more than
        `threshold` (`order`: +1 when lower values are more important, -1 when higher ones are).
        The least important go first, the latest to arrive first among equals; only as many as
        `req` needs (its extend and clipped output, and a request slot when `need_slot`), and
        none unless that many suffice. Returns whether any was preempted."""
        running = sorted(
            (r for r in self.running_batch.reqs if r not in self.preempt_list and not r.finished()),
            key=lambda r: (-order * r.priority, -r.time_stats.wait_queue_entry_time),
        )
        # add_one_req admits while what it needs is below rem_total_tokens: `need` must end below 0
        need = ceil_paged_tokens(req.extend_input_len, self.page_size) + min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS) - self.rem_total_tokens
        chosen: List[Req] = []
        locks: Dict[int, int] = {}  # tree node -> its locks once the chosen ones let go
        for r in running:
            if need < 0 and (chosen or not need_slot):
                break
            if -order * (req.priority - r.priority) <= threshold:
                break  # (sorted: no later one is less important)
            chosen.append(r)
            # what its release gives back: its output budget, the KV past its radix-tree prefix,
            # and the prefix nodes no one else (not `req`, which holds its own match) still locks
            need -= self._reservation(r) + r.kv_committed_len - len(r.prefix_indices) + self._unlocked_by(r, locks)
        if not chosen or need >= 0:
            return False
        # the victims' decode rows no longer ride in a mixed batch: what they give back to the
        # input and chunk budgets must let `req` in, or preempting them would only waste their work
        back = len(chosen) * self.decode_row_tokens
        input_tokens = ceil_paged_tokens(req.extend_input_len, self.page_size)
        if self.can_run_list and input_tokens >= self.rem_input_tokens + back:
            return False
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens + back < min(input_tokens, self.page_size):
            return False
        indices = {id(r) for r in chosen}
        keep = [i for i, r in enumerate(self.running_batch.reqs) if id(r) not in indices]
        for i, r in enumerate(list(self.running_batch.reqs)):
            if id(r) in indices:
                self.rem_total_token_offset -= self._reservation(r) + self.decode_row_tokens
                self.cur_rem_token_offset -= self.decode_row_tokens
                self.running_batch.release_req(i, remaining_count=len(keep))
        self.rem_input_tokens += back
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens += back
        self.running_batch.filter_batch(keep_indices=keep)
        self.preempt_list.extend(chosen)
        return True

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admit `req` whole, or truncated to a chunk, or say which budget stops it (§2.5)."""
        if self.prefill_max_requests is not None and len(self.can_run_list) >= self.prefill_max_requests:
            return self._stop(AddReqResult.OTHER, f"prefill_max_requests ({self.prefill_max_requests}) reached")
        max_new_tokens = req.sampling_params.max_new_tokens
        total_tokens = req.extend_input_len + min(max(max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        real_input_tokens = ceil_paged_tokens(req.extend_input_len, self.page_size)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return self._no_token(req, total_tokens)
        # the first request of a batch may exceed max_prefill_tokens (never memory)
        if real_input_tokens >= self.rem_input_tokens and len(self.can_run_list) != 0:
            return self._stop(AddReqResult.OTHER, f"{req.rid}: {real_input_tokens} input tokens exceed rem_input_tokens")
        with self.lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return self._no_token(req, total_tokens)
            input_tokens = ceil_paged_tokens(req.extend_input_len, self.page_size)
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                self.can_run_list.append(req)
                self.tree_cache.inc_lock_ref(req.last_node)
                self.tree_cache.record_hit(req.last_node)
                self._update_prefill_budget(prefix_len, input_tokens, min(max_new_tokens, CLIP_MAX_NEW_TOKENS))
            else:
                trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
                if trunc_len <= 0:
                    return self._stop(AddReqResult.OTHER, f"{req.rid}: less than one page of rem_chunk_tokens left")
                req.set_extend_input_len(trunc_len)
                req.fill_ids = req.fill_ids[: prefix_len + trunc_len]
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.tree_cache.inc_lock_ref(req.last_node)
                self.tree_cache.record_hit(req.last_node)
                # a truncated request reserves no output tokens yet
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()

    def _no_token(self, req: Req, total_tokens: int) -> AddReqResult:
        return self._stop(
            AddReqResult.NO_TOKEN,
            f"{req.rid}: needs {total_tokens} tokens (extend + max_new) >= rem_total_tokens {int(self.rem_total_tokens)}",
        )


def _common_prefix_len(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SchedulePolicy:
    """Orders the waiting queue before each prefill pass (§3)."""

    def __init__(self, policy: str, tree_cache: Any, seed: int = 0, priority_order: Optional[int] = None) -> None:
        """priority_order (--enable-priority-scheduling): +1 when lower priority values go first,
        -1 when higher ones do; None orders by the policy alone."""
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}")
        # a cache-aware policy without a cache is fcfs (SGLang's rule; said once, at start)
        if policy in CACHE_AWARE_POLICIES and getattr(tree_cache, "disable", False):
            logger.warning("--schedule-policy %s orders by prefix-cache matches; with --disable-radix-cache it is fcfs", policy)
            policy = "fcfs"
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)  # "random": its own RNG, not the process's (an Engine shares that with its user)
        self.priority_order = priority_order

    def calc_priority(self, waiting_queue: List[Req]) -> None:
        """Sort waiting_queue in place. fcfs keeps arrival order (retracted requests at the tail).
        With priority scheduling the requests' priorities order it first, the policy within one
        priority (a stable sort after the policy's: SGLang's fcfs sorts by (priority, arrival))."""
        self._order_by_policy(waiting_queue)
        if self.priority_order is not None:
            waiting_queue.sort(key=lambda r: self.priority_order * r.priority)

    def _order_by_policy(self, waiting_queue: List[Req]) -> None:
        policy = self.policy
        if policy == "lpm" and len(waiting_queue) > LPM_FALLBACK_QUEUE_LEN:
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "lof":
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        elif policy == "lpm":
            deprioritized = self._compute_prefix_matches(waiting_queue)
            waiting_queue.sort(key=lambda r: float("inf") if r.rid in deprioritized else -len(r.prefix_indices))
        else:  # dfs-weight
            self._compute_prefix_matches(waiting_queue)
            self._sort_by_dfs_weight(waiting_queue)

    def _compute_prefix_matches(self, waiting_queue: List[Req]) -> set:
        """Match every queued request against the tree; return rids to deprioritize.

        In-batch prefix caching: when a request's tree match is short but an earlier
        queued request shares a long prefix with it, let that one fill the cache first
        (SGLang simulates this with a second radix tree; a pairwise common-prefix scan
        gives the same answer: under lpm it never sees more than 128 requests, under
        dfs-weight it scans the whole queue).
        """
        deprioritized = set()
        in_queue: List[Tuple[Optional[str], List[int]]] = []  # (extra_key, prompt) that will populate the cache first
        for r in waiting_queue:
            # what a match may cover, as SGLang's: a request whose prompt logprobs start at 0 can
            # reuse nothing, so it waits for no other request to fill the cache
            key = r.max_prefix_ids()
            match = self.tree_cache.match_prefix(key, r.extra_key)
            r.prefix_indices, r.last_node = match.device_indices, match.last_device_node
            if len(r.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue
            # (only a prompt under the same adapter will fill a prefix this request can reuse)
            best = max((_common_prefix_len(key, other) for extra, other in in_queue if extra == r.extra_key), default=0)
            if best >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                deprioritized.add(r.rid)
            else:
                in_queue.append((r.extra_key, key))
        return deprioritized

    @staticmethod
    def _sort_by_dfs_weight(waiting_queue: List[Req]) -> None:
        """Group by matched node; DFS from the root, heavier subtrees first, post-order."""
        by_node: Dict[int, List[Req]] = defaultdict(list)
        nodes: Dict[int, Any] = {}
        for r in waiting_queue:
            by_node[id(r.last_node)].append(r)
            nodes[id(r.last_node)] = r.last_node
        weight: Dict[int, int] = defaultdict(int)
        root = None
        for key, node in nodes.items():
            n = node
            while n is not None:
                weight[id(n)] += len(by_node[key])
                root = n
                n = n.parent
        out: List[Req] = []

        def visit(node: Any) -> None:
            for child in sorted(node.children.values(), key=lambda c: -weight[id(c)]):
                if weight[id(child)] > 0:
                    visit(child)
            out.extend(by_node.get(id(node), []))

        if root is not None:
            visit(root)
        waiting_queue[:] = out
