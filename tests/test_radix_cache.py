"""RadixCache: hand-made cases for match/insert/split, locks, LRU eviction and the two
request hooks, then a hypothesis state machine that runs a scheduler-like workload
(shared prefixes, chunked prefill, decode, retraction, eviction under memory pressure)
with check_integrity and a KV-content check after every step, for page_size 1 and 16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.mem_cache.allocator import make_allocator
from minisgl.mem_cache.memory_pool import ReqToTokenPool
from minisgl.mem_cache.radix_cache import RadixCache


@dataclass
class SimReq:
    """The Req fields RadixCache uses (the scheduler's Req has the same names)."""

    origin_input_ids: List[int]
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    max_new_tokens: int = 4


def make_cache(page_size: int = 1, size: int = 64, disable: bool = False, rows: int = 4, ctx: int = 128):
    alloc = make_allocator(size, page_size)
    pool = ReqToTokenPool(rows, ctx)
    return RadixCache(pool, alloc, page_size, disable=disable), alloc, pool


def run_prefill(cache: RadixCache, req: SimReq) -> None:
    """What the scheduler does to admit and prefill a request in one pass."""
    full = req.origin_input_ids + req.output_ids
    match = cache.match_prefix(full[: len(full) - 1])
    req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
    req.cache_protected_len = len(req.prefix_indices)
    cache.inc_lock_ref(req.last_node)
    req.fill_ids = full
    extend_to(cache, req, len(full))


def extend_to(cache: RadixCache, req: SimReq, end: int) -> bool:
    """Allocate and write row positions [len(prefix_indices), end); False when out of memory."""
    pool, alloc = cache.req_to_token_pool, cache.token_to_kv_pool_allocator
    if req.req_pool_idx < 0:
        req.req_pool_idx = pool.alloc(1)[0]
    prefix_len = len(req.prefix_indices)
    cache.evict_if_needed(end - prefix_len + cache.page_size)
    last_loc = int(req.prefix_indices[-1]) if prefix_len else -1
    out = alloc.alloc_extend([prefix_len], [end], [last_loc], end - prefix_len)
    if out is None:
        return False
    pool.req_to_token[req.req_pool_idx, :prefix_len] = req.prefix_indices
    pool.req_to_token[req.req_pool_idx, prefix_len:end] = out
    req.kv_committed_len = end
    return True


def finish(cache: RadixCache, req: SimReq, is_insert: bool = True) -> None:
    cache.cache_finished_req(req, is_insert=is_insert)
    cache.req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = -1


def row(cache: RadixCache, req: SimReq, n: int) -> List[int]:
    return cache.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()


# ---------------------------------------------------------------- match / insert / split
def test_match_insert_and_split_page1() -> None:
    cache, alloc, _ = make_cache()
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.insert([1, 2, 3, 4, 5], slots) == 5, "a second insert finds everything present"
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_indices.tolist() == slots.tolist() and m.last_device_node.key == [1, 2, 3, 4, 5]
    m = cache.match_prefix([1, 2, 9])
    assert m.device_indices.tolist() == slots[:2].tolist()
    assert m.last_device_node.key == [1, 2] and [c.key for c in m.last_device_node.children.values()] == [[3, 4, 5]]
    other = alloc.alloc(2)
    assert cache.insert([1, 2, 7, 8], torch.cat((slots[:2], other))) == 2
    assert cache.match_prefix([1, 2, 7, 8]).device_indices.tolist() == slots[:2].tolist() + other.tolist()
    assert cache.match_prefix([5, 1]).device_indices.numel() == 0
    assert cache.total_size() == 7 and cache.evictable_size() == 7
    cache.check_integrity(total=64)


def test_page16_matches_whole_pages_only() -> None:
    P = 16
    cache, alloc, _ = make_cache(page_size=P, size=P * 8)
    key = list(range(100, 132))  # two pages
    slots = alloc.alloc(32)
    cache.insert(key, slots)
    assert cache.match_prefix(key[:31]).device_indices.tolist() == slots[:16].tolist(), "partial page not matched"
    assert cache.match_prefix(key[:15]).device_indices.numel() == 0
    diverge = key[:20] + [7] * 12  # differs inside the second page
    m = cache.match_prefix(diverge)
    assert len(m.device_indices) == 16 and len(m.last_device_node.key) == 16, "split at the page boundary"
    with pytest.raises(AssertionError, match="whole pages"):
        cache.insert(key[:20], slots[:20])
    second = alloc.alloc(16)
    assert cache.insert(diverge, torch.cat((slots[:16], second))) == 16
    assert len(m.last_device_node.children) == 2  # children keyed by their first page
    cache.check_integrity(total=P * 8)


@pytest.mark.parametrize("P", [1, 4])
def test_extra_keys_namespace_the_tree(P: int) -> None:
    """SGLang's RadixKey.extra_key (a LoRA adapter's name): the same tokens under two namespaces are
    two paths that never share slots; splits, eviction and the summary keep each node in its own."""
    cache, alloc, _ = make_cache(page_size=P, size=64)
    key = list(range(10, 18))
    base, a = alloc.alloc(8), alloc.alloc(8)
    assert cache.insert(key, base) == 0
    assert cache.match_prefix(key, "a").device_indices.numel() == 0, "base tokens matched under adapter a"
    assert cache.insert(key, a, extra_key="a") == 0, "a's insert reused the base model's slots"
    assert cache.match_prefix(key, "a").device_indices.tolist() == a.tolist()
    assert cache.match_prefix(key).device_indices.tolist() == base.tolist()
    assert cache.match_prefix(key, "b").device_indices.numel() == 0
    m = cache.match_prefix(key[:4] + [99] * 4, "a")  # splits a's node at 4, inside its namespace
    assert m.device_indices.tolist() == a[:4].tolist() and m.last_device_node.extra_key == "a"
    cache.check_integrity(total=64)
    tree = cache.summary()["tree"]
    assert [c["lora_id"] for c in tree["children"]] == [None, "a"]
    assert "lora=a" in cache.format_tree()
    assert cache.evict(64) == 16 and cache.total_size() == 0
    cache.check_integrity(total=64)


# ---------------------------------------------------------------- locks and eviction
def test_lock_moves_tokens_between_evictable_and_protected() -> None:
    cache, alloc, _ = make_cache()
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    node = cache.match_prefix([1, 2]).last_device_node  # splits [1,2 | 3,4]
    assert cache.inc_lock_ref(node) == -2
    assert (cache.evictable_size(), cache.protected_size()) == (2, 2)
    leaf = cache.match_prefix([1, 2, 3, 4]).last_device_node
    assert cache.inc_lock_ref(leaf) == -2 and cache.protected_size() == 4
    assert cache.evict(10) == 0, "locked nodes are never evicted"
    cache.dec_lock_ref(leaf)
    assert cache.evict(10) == 2 and cache.protected_size() == 2, "only the unlocked leaf goes"
    cache.dec_lock_ref(node)
    with pytest.raises(AssertionError, match="below zero"):
        cache.dec_lock_ref(node)


def test_lru_eviction_order_and_cascade() -> None:
    cache, alloc, _ = make_cache()
    cache.insert([1, 1, 1], alloc.alloc(3))  # A
    cache.insert([2, 2], alloc.alloc(2))  # B
    cache.insert([3, 3, 3, 3], alloc.alloc(4))  # C
    cache.match_prefix([1, 1, 1])  # A becomes the most recent
    assert cache.evict(1) == 2 and cache.match_prefix([2, 2]).device_indices.numel() == 0, "B was LRU"
    assert cache.evict(1) == 4 and cache.match_prefix([3, 3, 3, 3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1, 1]).device_indices.numel() == 3
    cache.reset()
    alloc.clear()
    cache.insert([5, 6, 7, 8], alloc.alloc(4))
    cache.insert([5, 6, 9], torch.cat((torch.tensor([1, 2]), alloc.alloc(1))))
    assert cache.evict(1) == 2, "the older leaf [7, 8] only: eviction stops once enough is freed"
    assert cache.evict(2) == 3, "leaf [9], then its parent [5, 6], now a childless unlocked leaf, cascades"
    assert cache.total_size() == 0 and alloc.available_size() == 64
    cache.check_integrity(total=64)


@pytest.mark.parametrize("policy, first", [("lru", "B"), ("mru", "A"), ("lfu", "C"), ("fifo", "A"), ("filo", "C")])
def test_each_eviction_policy_frees_its_leaf_first(policy: str, first: str) -> None:
    """--radix-eviction-policy: A, B, C inserted in that order; B reused by an admitted request (a
    hit), then C and A matched (no hit: a waiting request only looked)."""
    alloc = make_allocator(64, 1)
    cache = RadixCache(ReqToTokenPool(4, 128), alloc, 1, eviction_policy=policy)
    keys = {"A": [1, 1, 1], "B": [2, 2], "C": [3, 3, 3, 3]}
    for key in keys.values():
        cache.insert(key, alloc.alloc(len(key)))
    cache.record_hit(cache.match_prefix(keys["B"]).last_device_node)
    cache.match_prefix(keys["C"])
    cache.match_prefix(keys["A"])
    cache.evict(1)
    assert [name for name, key in keys.items() if cache.match_prefix(key).device_indices.numel() == 0] == [first]
    cache.check_integrity(total=64)


def test_a_split_node_keeps_its_age_importance_and_hits() -> None:
    """A prefix split off by a later match is as old as the tokens it holds (fifo), keeps the
    importance of the requests that inserted it (priority) and the hits on them (lfu)."""
    alloc = make_allocator(64, 1)
    cache = RadixCache(ReqToTokenPool(4, 128), alloc, 1, eviction_policy="fifo")
    cache.insert([1, 2, 3, 4], alloc.alloc(4), importance=5.0)  # old
    cache.insert([9, 9], alloc.alloc(2))  # newer
    cache.record_hit(cache.match_prefix([1, 2, 3, 4]).last_device_node)
    node = cache.match_prefix([1, 2]).last_device_node  # splits [1, 2] | [3, 4]
    assert (node.creation_time, node.importance, node.hit_count) == (node.children[3].creation_time, 5.0, 1)
    assert cache.evict(1) == 2 and cache.match_prefix([1, 2, 3]).device_indices.numel() == 2  # the old leaf [3, 4] first
    cache.check_integrity(total=64)


def test_priority_eviction_frees_the_least_important_requests_prefixes_first() -> None:
    """The priority policy keeps what important requests cached: each node holds the highest
    importance that inserted through it (a request's priority, made "higher is more important")."""
    alloc = make_allocator(64, 1)
    cache = RadixCache(ReqToTokenPool(4, 128), alloc, 1, eviction_policy="priority", priority_order=-1)
    low, high = SimReq(origin_input_ids=[1]), SimReq(origin_input_ids=[2])
    low.priority, high.priority = 0, 10  # type: ignore[attr-defined]
    cache.insert([5, 5, 5], alloc.alloc(3), cache.importance(high))
    cache.insert([6, 6], alloc.alloc(2), cache.importance(low))
    cache.match_prefix([5, 5, 5])  # (lru alone would evict [6, 6] too: use [6, 6] last)
    cache.match_prefix([6, 6])
    assert cache.evict(1) == 2 and cache.match_prefix([5, 5, 5]).device_indices.numel() == 3
    low_first = RadixCache(ReqToTokenPool(4, 128), alloc, 1, eviction_policy="priority", priority_order=+1)
    assert low_first.importance(low) > low_first.importance(high)  # (lower values first: 0 is the more important)


def test_evict_if_needed_only_when_short() -> None:
    cache, alloc, _ = make_cache(size=8)
    cache.insert([1, 2, 3, 4, 5, 6], alloc.alloc(6))
    assert cache.evict_if_needed(2) == 0 and cache.evictable_size() == 6
    assert cache.evict_if_needed(3) == 6 and alloc.available_size() == 8


# ---------------------------------------------------------------- request hooks
def test_cache_finished_req_frees_duplicates_and_tail_page1() -> None:
    cache, alloc, pool = make_cache()
    a, b = SimReq([1, 2, 3, 4, 5]), SimReq([1, 2, 3, 4, 5])
    run_prefill(cache, a)
    run_prefill(cache, b)  # admitted before a finished: no sharing, duplicate KV
    assert alloc.available_size() == 64 - 10
    a.output_ids, b.output_ids = [6], [7]  # sampled tokens have no KV yet: kv_committed_len stays 5
    finish(cache, a)
    assert cache.evictable_size() == 5
    finish(cache, b)
    assert alloc.available_size() == 64 - 5, "b's 5 duplicate slots went back to the allocator"
    assert cache.protected_size() == 0 and b.last_node is None
    cache.check_integrity(total=64)
    with pytest.raises(AssertionError, match="already released"):
        cache.cache_finished_req(b)


def test_cache_finished_req_frees_unaligned_tail_page16() -> None:
    P = 16
    cache, alloc, _ = make_cache(page_size=P, size=P * 8)
    req = SimReq(list(range(40)))
    run_prefill(cache, req)
    assert alloc.available_size() == P * 8 - 48  # 3 pages
    finish(cache, req)
    assert cache.evictable_size() == 32 and alloc.available_size() == P * 8 - 32, "tail page freed"
    again = SimReq(list(range(40)))
    run_prefill(cache, again)
    assert again.cache_protected_len == 32 and row(cache, again, 32) == list(range(P, 3 * P))
    finish(cache, again, is_insert=False)
    assert alloc.available_size() == P * 8 - 32 and cache.protected_size() == 0
    cache.check_integrity(total=P * 8)


def test_cache_unfinished_req_moves_lock_and_rewrites_row() -> None:
    cache, alloc, pool = make_cache()
    first = SimReq([1, 2, 3, 4, 5, 6])
    run_prefill(cache, first)
    first.output_ids = [9]
    finish(cache, first)  # the tree holds [1..6] at slots 1..6
    req = SimReq([1, 2, 3, 4, 5, 6, 7, 8])
    req.req_pool_idx = pool.alloc(1)[0]
    # scheduled without a match (e.g. admitted in the same batch): it wrote its own slots
    req.last_node, req.fill_ids = cache.root_node, req.origin_input_ids[:7]
    cache.inc_lock_ref(req.last_node)
    extend_to(cache, req, 7)
    own = row(cache, req, 7)
    cache.cache_unfinished_req(req, chunked=True)
    assert row(cache, req, 7) == [1, 2, 3, 4, 5, 6, own[6]], "row now points at the tree's slots"
    assert alloc.is_free(torch.tensor(own[:6])).all(), "the duplicates were freed"
    assert req.prefix_indices.tolist() == row(cache, req, 7) and req.cache_protected_len == 7
    assert req.last_node.lock_ref == 1 and cache.protected_size() == 7 and cache.evictable_size() == 0
    cache.check_integrity(available_size=alloc.available_size(), total=64)
    req.fill_ids = req.origin_input_ids
    extend_to(cache, req, 8)
    req.output_ids = [3]
    finish(cache, req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    cache.check_integrity(total=64)


def test_disable_mode_never_caches() -> None:
    cache, alloc, pool = make_cache(disable=True)
    req = SimReq([1, 2, 3, 4])
    run_prefill(cache, req)
    assert req.prefix_indices.numel() == 0 and req.last_node is cache.root_node
    req.output_ids = [5]
    finish(cache, req)
    assert alloc.available_size() == 64 and cache.total_size() == 0
    again = SimReq([1, 2, 3, 4], output_ids=[5])
    run_prefill(cache, again)
    assert again.prefix_indices.numel() == 0, "nothing is ever matched"
    again.fill_ids = again.origin_input_ids[:2]
    cache.cache_unfinished_req(again, chunked=True)
    assert again.prefix_indices.tolist() == row(cache, again, 2), "chunked requests continue from their row"
    assert cache.evict(10) == 0 and cache.summary()["num_nodes"] == 1


# ---------------------------------------------------------------- inspection
def test_check_integrity_catches_corruption() -> None:
    cache, alloc, _ = make_cache()
    slots = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    cache.check_integrity(total=64)
    cache.evictable_size_ += 1
    with pytest.raises(AssertionError, match="evictable_size_"):
        cache.check_integrity()
    cache.evictable_size_ -= 1
    alloc.free(slots[:1])  # freed while the tree still references it
    with pytest.raises(AssertionError, match="free list"):
        cache.check_integrity()
    cache.reset()
    alloc.clear()
    cache.insert([1, 2], alloc.alloc(2))
    cache.insert([3, 4], torch.tensor([1, 2]))  # the same slots under two prefixes
    with pytest.raises(AssertionError, match="appear twice"):
        cache.check_integrity()
    cache.reset()
    alloc.clear()
    cache.insert([1, 2], alloc.alloc(2))
    with pytest.raises(AssertionError, match="memory leak or double free"):
        cache.check_integrity(total=64 + 1)
    next(iter(cache.root_node.children.values())).value = torch.tensor([1])
    with pytest.raises(AssertionError, match="KV slots"):
        cache.check_integrity()


def test_summary_shape_and_trimming() -> None:
    cache, alloc, _ = make_cache()
    for first in range(1, 6):
        cache.insert([first] * 10 + [0], alloc.alloc(11))
    node = cache.match_prefix([1] * 10).last_device_node
    cache.inc_lock_ref(node)
    cache.record_hit(node)
    s = cache.summary(max_nodes=4)
    assert (s["num_nodes"], s["total_tokens"], s["evictable"], s["protected"]) == (7, 55, 45, 10)
    assert s["tree"]["id"] == 0 and s["tree"]["lock_ref"] == 1 and len(s["tree"]["children"]) == 3
    child = s["tree"]["children"][0]
    assert child["tokens_preview"] == [1] * 8 and child["len"] == 10 and child["lock_ref"] == 1 and child["hits"] == 1
    text = cache.format_tree()
    assert "lock_ref=1 hits=1" in text and text.count("\n") == 6


# ---------------------------------------------------------------- workload state machine
def kv_tag(tokens: List[int]) -> int:
    """What the K/V at a position depends on: the whole prefix up to it."""
    return hash(tuple(tokens))


class RadixWorkload(RuleBasedStateMachine):
    """A miniature scheduler: admission (match, lock, alloc, write row), chunked prefill
    (cache_unfinished_req), decode, finish (cache_finished_req + free row), retraction
    (cache_finished_req(is_insert=False)) and eviction, over a fake KV pool that records
    which prefix each slot's K/V belongs to."""

    page_size = 1
    pool_tokens = 40

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.alloc, self.pool = make_cache(self.page_size, self.pool_tokens, rows=4, ctx=256)
        self.kv: Dict[int, int] = {}  # KV slot -> kv_tag of the prefix whose K/V it holds
        self.waiting: List[SimReq] = []
        self.running: List[SimReq] = []
        self.chunked: Optional[SimReq] = None
        self.chunk_size = 2 * self.page_size + 1
        self.bases = [[1 + (i * 7 + j) % 3 for j in range(6 * self.page_size)] for i in range(2)]
        self.alloc.free = self._poisoning_free(self.alloc.free)

    def _poisoning_free(self, free: Any) -> Any:
        """Forget the K/V tag of every freed slot (whole pages), so a row or tree node that
        still points at a freed slot fails the content check at once, not after reuse."""
        P = self.page_size

        def poisoning_free(index: torch.Tensor) -> None:
            for page in torch.unique(index // P).tolist():
                for slot in range(page * P, page * P + P):
                    self.kv.pop(slot, None)
            free(index)

        return poisoning_free

    # -- helpers
    def _write_kv(self, req: SimReq, start: int, end: int) -> None:
        full = req.origin_input_ids + req.output_ids
        for pos, slot in enumerate(row(self.cache, req, end)[start:end], start=start):
            self.kv[slot] = kv_tag(full[: pos + 1])

    def _admit_chunk(self, req: SimReq, end: int) -> bool:
        start = len(req.prefix_indices)
        req.fill_ids = (req.origin_input_ids + req.output_ids)[:end]
        if not extend_to(self.cache, req, end):
            return False
        self._write_kv(req, start, end)
        return True

    def _release(self, req: SimReq, is_insert: bool) -> None:
        finish(self.cache, req, is_insert=is_insert)

    def _retract(self, req: SimReq) -> None:
        """Out of memory mid-flight: give the KV back and re-queue with outputs kept."""
        if req.req_pool_idx < 0:  # never got a row: only the lock is held
            self.cache.dec_lock_ref(req.last_node)
            req.last_node = None
        else:
            self._release(req, is_insert=False)
        req.prefix_indices, req.cache_protected_len, req.kv_committed_len = torch.empty(0, dtype=torch.int64), 0, 0
        self.waiting.append(req)

    def _prefill_done(self, req: SimReq, token: int) -> None:
        req.output_ids.append(token)
        self.cache.cache_unfinished_req(req)
        self.running.append(req)

    # -- rules
    @rule(base=st.integers(0, 1), cut=st.integers(0, 6), suffix=st.lists(st.integers(1, 3), max_size=3),
          max_new=st.integers(1, 6))
    def arrive(self, base: int, cut: int, suffix: List[int], max_new: int) -> None:
        prompt = self.bases[base][: cut * self.page_size] + suffix
        if not prompt:
            prompt = [1]
        self.waiting.append(SimReq(prompt, max_new_tokens=max_new))

    @precondition(lambda self: self.waiting and self.chunked is None and self.pool.available_size() > 0)
    @rule(num_reqs=st.integers(1, 3), tokens=st.lists(st.integers(1, 3), min_size=3, max_size=3))
    def admit(self, num_reqs: int, tokens: List[int]) -> None:
        """One prefill batch: every request is matched and locked before any computes, so
        requests with the same prompt in one batch each compute (and later free) copies."""
        batch = self.waiting[: min(num_reqs, self.pool.available_size())]
        del self.waiting[: len(batch)]
        for req in batch:
            full = req.origin_input_ids + req.output_ids
            match = self.cache.match_prefix(full[: len(full) - 1])
            req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
            req.cache_protected_len = len(req.prefix_indices)
            self.cache.inc_lock_ref(req.last_node)
        for i, (req, token) in enumerate(zip(batch, tokens)):
            full_len = len(req.origin_input_ids) + len(req.output_ids)
            # only the last request of a batch may be chunked, as in the PrefillAdder
            end = min(full_len, len(req.prefix_indices) + self.chunk_size) if i == len(batch) - 1 else full_len
            self._advance(req, end, full_len, token)

    @precondition(lambda self: self.chunked is not None)
    @rule(token=st.integers(1, 3))
    def next_chunk(self, token: int) -> None:
        req = self.chunked
        full_len = len(req.origin_input_ids) + len(req.output_ids)
        end = min(full_len, len(req.prefix_indices) + self.chunk_size)
        self.chunked = None
        self._advance(req, end, full_len, token)

    def _advance(self, req: SimReq, end: int, full_len: int, token: int) -> None:
        """Prefill `req` up to `end`: retracted if it does not fit, chunked if short of `full_len`, else done."""
        if not self._admit_chunk(req, end):
            self._retract(req)
        elif end < full_len:
            self.cache.cache_unfinished_req(req, chunked=True)
            self.chunked = req
        else:
            self._prefill_done(req, token)

    @precondition(lambda self: self.running)
    @rule(tokens=st.lists(st.integers(1, 3), min_size=4, max_size=4))
    def decode(self, tokens: List[int]) -> None:
        self.alloc.free_group_begin()
        for req in [r for r in self.running if len(r.output_ids) >= r.max_new_tokens]:
            self.running.remove(req)  # finished: KV of origin + output[:-1] goes to the tree
            req.kv_committed_len = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._release(req, is_insert=True)
        self.alloc.free_group_end()
        if not self.running:
            return
        self.cache.evict_if_needed(len(self.running) * self.page_size)
        positions = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in self.running]
        last_loc = [row(self.cache, r, p)[-1] for r, p in zip(self.running, positions)]
        out = self.alloc.alloc_decode([p + 1 for p in positions], last_loc)
        if out is None:
            self._retract(self.running.pop())  # SGLang retracts and retries; one is enough here
            return
        for req, pos, slot, token in zip(self.running, positions, out.tolist(), tokens):
            self.pool.req_to_token[req.req_pool_idx, pos] = slot
            req.kv_committed_len = pos + 1
            self._write_kv(req, pos, pos + 1)
            req.output_ids.append(token)

    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    # -- invariants
    def _held_outside_tree(self) -> int:
        P = self.page_size
        reqs = self.running + ([self.chunked] if self.chunked else [])
        return sum((r.kv_committed_len + P - 1) // P * P - r.cache_protected_len for r in reqs)

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(self.alloc.available_size() + self._held_outside_tree(), self.alloc.size)

    @invariant()
    def kv_contents_match_tokens(self) -> None:
        stack = [(self.cache.root_node, [])]
        while stack:
            node, path = stack.pop()
            path = path + node.key
            for i, slot in enumerate(node.value.tolist()):
                expected = kv_tag(path[: len(path) - len(node.key) + i + 1])
                assert self.kv.get(slot) == expected, f"tree slot {slot} is freed or holds other KV"
            stack.extend((c, path) for c in node.children.values())
        for req in self.running + ([self.chunked] if self.chunked else []):
            full = req.origin_input_ids + req.output_ids
            for pos, slot in enumerate(row(self.cache, req, req.kv_committed_len)):
                assert self.kv.get(slot) == kv_tag(full[: pos + 1]), f"row position {pos} reads a freed or foreign slot"

    def teardown(self) -> None:
        for req in self.running:
            req.kv_committed_len = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._release(req, is_insert=True)
        if self.chunked is not None:
            self._release(self.chunked, is_insert=False)
        self.running, self.chunked = [], None
        self.integrity()
        assert self.cache.protected_size() == 0
        assert self.alloc.available_size() + self.cache.evictable_size() == self.alloc.size
        assert self.pool.available_size() == self.pool.size
        self.cache.evict(self.alloc.size)
        assert self.alloc.available_size() == self.alloc.size and self.cache.total_size() == 0


class RadixWorkloadPage16(RadixWorkload):
    page_size = 16
    pool_tokens = 16 * 12


_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestRadixWorkloadPage1 = RadixWorkload.TestCase
TestRadixWorkloadPage1.settings = _SETTINGS
TestRadixWorkloadPage16 = RadixWorkloadPage16.TestCase
TestRadixWorkloadPage16.settings = _SETTINGS


# Eviction amounts and LRU freshness (sglang-facts §5): what stays cached decides the next
# request's cached_tokens.
def test_evict_stops_as_soon_as_enough_is_freed() -> None:
    cache, alloc, _ = make_cache()
    cache.insert([1, 1], alloc.alloc(2))  # oldest
    cache.insert([2, 2], alloc.alloc(2))
    cache.insert([3, 3], alloc.alloc(2))
    assert cache.evict(2) == 2, "the LRU leaf alone frees exactly 2: nothing else goes"
    assert cache.match_prefix([2, 2]).device_indices.numel() == 2
    assert cache.evictable_size() == 4
    cache.check_integrity(total=64)


def test_evict_if_needed_evicts_the_whole_request_not_the_shortfall() -> None:
    # SGLang's alloc_token_slots: when short, evict num_tokens, so the step's next allocations fit too
    cache, alloc, _ = make_cache(size=8)
    for t in range(6):
        cache.insert([10 + t], alloc.alloc(1))  # six 1-token leaves, 2 slots free
    assert cache.evict_if_needed(3) == 3 and alloc.available_size() == 5
    cache.check_integrity(total=8)


def test_reinserting_a_cached_sequence_makes_it_the_most_recent() -> None:
    # A finished request whose tokens were all cached already (a repeated prompt) inserts a
    # path that exists: that use must count for LRU, or it is evicted before older entries.
    cache, alloc, _ = make_cache()
    a = alloc.alloc(3)
    cache.insert([1, 2, 3], a)
    cache.insert([7, 7, 7], alloc.alloc(3))
    assert cache.insert([1, 2, 3], a) == 3  # used again, most recently
    assert cache.evict(3) == 3
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == a.tolist(), "the older [7, 7, 7] goes first"
    assert cache.match_prefix([7, 7, 7]).device_indices.numel() == 0


def test_the_eviction_policy_option_is_checked() -> None:
    from minisgl.server_args import ServerArgs

    with pytest.raises(ValueError, match="--radix-eviction-policy must be one of lru, mru, lfu, fifo, filo, priority"):
        ServerArgs(model_path="m", radix_eviction_policy="random")
    assert ServerArgs(model_path="m", radix_eviction_policy="lfu").radix_eviction_policy == "lfu"
    with pytest.raises(ValueError, match="priority requires --enable-priority-scheduling"):
        ServerArgs(model_path="m", radix_eviction_policy="priority")
    assert ServerArgs(model_path="m", radix_eviction_policy="priority", enable_priority_scheduling=True).radix_eviction_policy == "priority"
