"""SchedulePolicy orders the waiting queue (sglang-facts §3): lpm by cached prefix length,
with its fcfs fallback above 128 waiting requests and in-batch prefix caching; dfs-weight
by subtree weight; random is a permutation."""

from __future__ import annotations

import random
from typing import List

from minisgl import SamplingParams
from minisgl.managers.schedule_batch import Req
from minisgl.managers.schedule_policy import (
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, LPM_FALLBACK_QUEUE_LEN, SchedulePolicy,
)  # fmt: skip
from minisgl.mem_cache.allocator import make_allocator
from minisgl.mem_cache.memory_pool import ReqToTokenPool
from minisgl.mem_cache.radix_cache import RadixCache


def _tree() -> RadixCache:
    allocator = make_allocator(4096, 1)
    return RadixCache(ReqToTokenPool(4, 512), allocator, 1)


def _cache(tree: RadixCache, tokens: List[int]) -> None:
    """Put `tokens` into the tree as if a finished request had computed them."""
    slots = tree.token_to_kv_pool_allocator.alloc(len(tokens))
    tree.insert(tokens, slots)


def _req(rid: str, ids: List[int]) -> Req:
    params = SamplingParams(max_new_tokens=4)
    params.normalize()
    return Req(rid, None, ids, params)


def test_lpm_puts_the_longest_cached_prefix_first() -> None:
    tree = _tree()
    _cache(tree, list(range(100, 160)))  # 60 tokens cached
    queue = [_req("none", list(range(500, 540))), _req("short", list(range(100, 110)) + [7] * 30),
             _req("long", list(range(100, 150)) + [8] * 5)]  # fmt: skip
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["long", "short", "none"]
    assert [len(r.prefix_indices) for r in queue] == [50, 10, 0]


def test_lpm_falls_back_to_fcfs_above_128_waiting() -> None:
    tree = _tree()
    _cache(tree, list(range(100, 160)))
    queue = [_req(f"r{i}", list(range(500 + i, 540 + i))) for i in range(LPM_FALLBACK_QUEUE_LEN)]
    queue.append(_req("hit", list(range(100, 150)) + [9]))
    order = [r.rid for r in queue]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == order  # 129 waiting: arrival order, no matching
    short = queue[-LPM_FALLBACK_QUEUE_LEN:]  # 128 waiting: lpm applies
    SchedulePolicy("lpm", tree).calc_priority(short)
    assert short[0].rid == "hit"


def test_lpm_in_batch_prefix_caching_defers_requests_sharing_a_queued_prefix() -> None:
    # nothing cached; "b" shares a 40-token prefix with "a", which is ahead of it: let "a"
    # fill the cache first and run "b" after the unrelated "c"
    tree = _tree()
    shared = list(range(1000, 1040))
    queue = [_req("a", shared + [1, 2]), _req("b", shared + [3, 4]), _req("c", list(range(2000, 2010)))]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "c", "b"]


def test_dfs_weight_serves_the_heaviest_subtree_first() -> None:
    tree = _tree()
    _cache(tree, list(range(100, 140)))  # subtree X
    _cache(tree, list(range(300, 340)))  # subtree Y
    x = [_req(f"x{i}", list(range(100, 140)) + [i]) for i in range(3)]
    y = [_req("y0", list(range(300, 340)) + [5])]
    cold = [_req("cold", list(range(900, 920)))]
    queue = [y[0], cold[0], *x]
    SchedulePolicy("dfs-weight", tree).calc_priority(queue)
    # X (3 requests) before Y (1); the root's own requests (no match) come last (post-order)
    assert [r.rid for r in queue] == ["x0", "x1", "x2", "y0", "cold"]


def test_random_is_a_permutation_and_cache_aware_policies_need_a_cache() -> None:
    tree = _tree()
    queue = [_req(str(i), [10 + i, 20 + i]) for i in range(20)]
    random.seed(0)
    SchedulePolicy("random", tree).calc_priority(queue)
    assert sorted(r.rid for r in queue) == sorted(str(i) for i in range(20))
    assert [r.rid for r in queue] != [str(i) for i in range(20)]
    disabled = RadixCache(ReqToTokenPool(4, 64), make_allocator(256, 1), 1, disable=True)
    assert SchedulePolicy("lpm", disabled).policy == "fcfs"


def test_lpm_defers_a_request_sharing_exactly_the_threshold_with_a_queued_one() -> None:
    tree = _tree()
    shared = list(range(1000, 1000 + IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD))
    queue = [_req("a", shared + [1, 2]), _req("b", shared + [3, 4]), _req("c", [7, 8, 9])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "c", "b"]


def test_lpm_defers_no_request_for_a_queued_prompt_of_another_adapter() -> None:
    """--lora-paths: a queued prompt fills the cache of its own adapter's namespace only, so a
    request under another adapter (or the base model) that shares its prefix is not deferred."""
    tree = _tree()
    shared = list(range(1000, 1000 + IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD))
    params = SamplingParams(max_new_tokens=4)
    params.normalize()
    queue = [Req("a", None, shared + [1, 2], params, lora_id="x"), Req("b", None, shared + [3, 4], params),
             Req("c", None, [7, 8, 9], params), Req("d", None, shared + [5, 6], params, lora_id="x")]  # fmt: skip
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "b", "c", "d"]  # only d (same adapter as a) waits for a


def test_lpm_defers_no_request_for_a_queued_prompt_of_another_cache_key() -> None:
    """extra_key / cache_salt: likewise per request key; the same key and adapter defers as usual."""
    tree = _tree()
    shared = list(range(2000, 2000 + IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD))
    params = SamplingParams(max_new_tokens=4)
    params.normalize()
    queue = [Req("a", None, shared + [1, 2], params, cache_key="t1"), Req("e", None, shared + [8, 9], params, cache_key="t1"),
             Req("b", None, shared + [3, 4], params, cache_key="t2"), Req("c", None, shared + [5, 6], params, lora_id="t1"),
             Req("d", None, shared + [7, 8], params)]  # fmt: skip
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "b", "c", "d", "e"]  # only e (a's key) waits for a
