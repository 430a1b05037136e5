"""PrefillAdder: each budget exhausted on purpose, with the AddReqResult and recorded reason (§2)."""

from __future__ import annotations

from typing import List, Optional

from minisgl import Engine, SamplingParams
from minisgl.managers.schedule_batch import Req, ScheduleBatch
from minisgl.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from minisgl.mem_cache.allocator import make_allocator
from minisgl.mem_cache.memory_pool import ReqToTokenPool
from minisgl.mem_cache.radix_cache import RadixCache


def _adder(pool_tokens: int, max_prefill: int = 16384, chunk: Optional[int] = None, page_size: int = 1,
           prefill_max_requests: Optional[int] = None) -> PrefillAdder:  # fmt: skip
    allocator = make_allocator(pool_tokens, page_size)
    req_pool = ReqToTokenPool(8, 512)
    tree = RadixCache(req_pool, allocator, page_size)
    running = ScheduleBatch.init_new([], req_pool, allocator, tree)
    return PrefillAdder(page_size, tree, allocator, running, 0.7, max_prefill, chunk, 0, prefill_max_requests)


def _req(rid: str, input_len: int, max_new: int, adder: PrefillAdder) -> Req:
    params = SamplingParams(max_new_tokens=max_new)
    params.normalize()
    req = Req(rid, None, list(range(1, input_len + 1)), params)
    req.init_next_round_input(adder.tree_cache)
    return req


def test_kv_budget_no_token_even_for_the_first_request() -> None:
    adder = _adder(pool_tokens=100)
    assert adder.add_one_req(_req("a", 60, 50, adder)) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == [] and adder.stop_reason == "NO_TOKEN"
    assert "rem_total_tokens" in adder.stop_detail and adder.budgets_at_stop["rem_total_tokens"] == 100


def test_input_budget_first_request_may_exceed_it_second_may_not() -> None:
    adder = _adder(pool_tokens=1000, max_prefill=50)
    first = _req("a", 80, 4, adder)
    assert adder.add_one_req(first) == AddReqResult.OTHER  # admitted, then budget spent
    assert adder.can_run_list == [first] and adder.rem_input_tokens == -30
    assert "rem_input_tokens" in adder.stop_detail


def test_input_budget_blocks_a_later_request() -> None:
    adder = _adder(pool_tokens=1000, max_prefill=50)
    assert adder.add_one_req(_req("a", 20, 4, adder)) == AddReqResult.CONTINUE
    assert adder.add_one_req(_req("b", 40, 4, adder)) == AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["a"]


def test_chunk_budget_truncates_and_page_aligns() -> None:
    adder = _adder(pool_tokens=1024, chunk=40, page_size=16)
    req = _req("a", 100, 4, adder)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert adder.new_chunked_req is req and req.extend_input_len == 32 and len(req.fill_ids) == 32
    # 8 tokens of chunk budget left: less than a page, so the next request cannot start
    assert adder.add_one_req(_req("b", 10, 4, adder)) == AddReqResult.OTHER
    assert "less than one page" in adder.stop_detail


def test_chunk_budget_exhausted_exactly() -> None:
    adder = _adder(pool_tokens=1024, chunk=64)
    req = _req("a", 100, 4, adder)
    assert adder.add_one_req(req) == AddReqResult.OTHER
    assert req.extend_input_len == 64 and "rem_chunk_tokens" in adder.stop_detail


def test_prefill_max_requests() -> None:
    adder = _adder(pool_tokens=1024, prefill_max_requests=1)
    assert adder.add_one_req(_req("a", 10, 4, adder)) == AddReqResult.CONTINUE
    assert adder.add_one_req(_req("b", 10, 4, adder)) == AddReqResult.OTHER
    assert "prefill_max_requests" in adder.stop_detail


def test_running_requests_reserve_ratio_scaled_output() -> None:
    adder = _adder(pool_tokens=1000)
    running = _req("r", 10, 100, adder)
    adder2 = PrefillAdder(1, adder.tree_cache, adder.token_to_kv_pool_allocator,
                          ScheduleBatch.init_new([running], None, adder.token_to_kv_pool_allocator, adder.tree_cache),
                          0.5, 16384, None)  # fmt: skip
    assert adder2.rem_total_tokens == 1000 - 100 * 0.5


def test_head_of_line_blocking_and_batch_full(tiny_model: str) -> None:
    greedy = {"temperature": 0, "ignore_eos": True}
    engine = Engine(tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=-1)
    engine.add_request(input_ids=list(range(10, 30)), sampling_params={**greedy, "max_new_tokens": 20}, rid="a")
    engine.add_request(input_ids=list(range(10, 110)), sampling_params={**greedy, "max_new_tokens": 60}, rid="big")
    engine.add_request(input_ids=list(range(10, 20)), sampling_params={**greedy, "max_new_tokens": 5}, rid="small")
    snap = engine.step()
    # "small" would fit, but admission stops at the first request that does not
    assert snap["adder"]["admitted"] == ["a"] and snap["adder"]["stop_reason"] == "NO_TOKEN"
    engine.run_until_idle()

    engine = Engine(tiny_model, device="cpu", max_total_tokens=1024, max_running_requests=2)
    for rid in "xyz":
        engine.add_request(input_ids=[11, 12, 13], sampling_params={**greedy, "max_new_tokens": 3}, rid=rid)
    snap = engine.step()
    assert snap["adder"]["admitted"] == ["x", "y"] and snap["adder"]["stop_reason"] == "BATCH_FULL"
    assert [r["rid"] for r in snap["waiting_queue"]] == ["z"]
    engine.run_until_idle()


def test_the_last_chunk_leaves_the_free_slot_to_the_queue(tiny_model: str) -> None:
    """max_running_requests=2: while L finishes its chunked prefill, S takes the other slot;
    it must not wait for L's whole decode (L's row was counted twice on its last chunk)."""
    greedy = {"temperature": 0, "ignore_eos": True}
    engine = Engine(tiny_model, device="cpu", max_total_tokens=1024, chunked_prefill_size=16, max_running_requests=2)
    engine.add_request(input_ids=list(range(10, 40)), sampling_params={**greedy, "max_new_tokens": 20}, rid="L")
    engine.add_request(input_ids=list(range(50, 60)), sampling_params={**greedy, "max_new_tokens": 2}, rid="S")
    first, last_chunk = engine.step(), engine.step()
    assert first["adder"]["admitted"] == ["L"]  # chunk 1 of 2 fills the chunk budget
    assert "S" in last_chunk["adder"]["admitted"] and last_chunk["adder"]["stop_reason"] != "BATCH_FULL"
    engine.run_until_idle()
    assert len(engine.get_result("S")["output_ids"]) == 2 and len(engine.get_result("L")["output_ids"]) == 20


def test_policies_order_the_queue() -> None:
    adder = _adder(pool_tokens=1000)
    reqs = [_req(str(i), 5 + i, m, adder) for i, m in enumerate([3, 9, 1])]
    queue = list(reqs)
    SchedulePolicy("lof", adder.tree_cache).calc_priority(queue)
    assert [r.rid for r in queue] == ["1", "0", "2"]
    queue = list(reqs)
    SchedulePolicy("fcfs", adder.tree_cache).calc_priority(queue)
    assert queue == reqs
    # lpm with an empty tree and no shared prefixes keeps arrival order (stable sort)
    SchedulePolicy("lpm", adder.tree_cache).calc_priority(queue)
    assert queue == reqs


def test_a_finished_request_frees_its_slot_for_the_very_next_step(tiny_model: str) -> None:
    """It lingers in running_batch after its last decode step: the next admission must not count it."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_running_requests=1, max_total_tokens=1024) as eng:
        a = eng.add_request(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 3})
        b = eng.add_request(input_ids=[8, 9, 10], sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 3})
        while not eng.rid_to_state[a].finished:
            eng.step(snapshot=False)
        snap = eng.step()  # the step right after A's last token
        assert snap["forward_mode"] == "EXTEND" and [r["rid"] for r in snap["batch"]["reqs"]] == [b]
        assert snap["adder"]["budgets"]["request_slots_left"] == 0  # B took the one slot A gave back
        eng.run_until_idle()


# Budgets at their edges (sglang-facts §2): what running requests still reserve, a request's
# own cached prefix, a chunk under memory pressure.
def _adder_with_running(adder: PrefillAdder, running: List[Req], ratio: float) -> PrefillAdder:
    batch = ScheduleBatch.init_new(running, None, adder.token_to_kv_pool_allocator, adder.tree_cache)
    return PrefillAdder(1, adder.tree_cache, adder.token_to_kv_pool_allocator, batch, ratio, 16384, 32)


def test_a_running_request_reserves_only_the_output_it_has_left() -> None:
    adder = _adder(pool_tokens=1000)
    running = _req("r", 10, 100, adder)
    running.output_ids = [5] * 40  # 60 of its 100 output tokens are still to come
    assert _adder_with_running(adder, [running], 0.5).rem_total_tokens == 1000 - 60 * 0.5


def test_a_requests_own_cached_prefix_is_not_counted_as_free_memory() -> None:
    # 60 cached tokens fill the pool with 40 free: a request that reuses them needs its 20 new
    # prompt tokens and 25 output tokens out of those 40, because its prefix cannot be evicted
    adder = _adder(pool_tokens=100)
    prefix = list(range(1, 61))
    adder.tree_cache.insert(prefix, adder.token_to_kv_pool_allocator.alloc(60))
    req = _req("a", 80, 25, adder)  # ids 1..80: its first 60 are the cached prefix
    assert len(req.prefix_indices) == 60 and req.extend_input_len == 20
    assert adder.add_one_req(req) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == [] and adder.tree_cache.protected_size() == 0  # the check's lock is undone


def test_a_chunked_request_without_memory_budget_still_takes_a_whole_chunk() -> None:
    # the running batch's reservation exceeds the pool: the chunk in progress is never stalled
    # nor slowed to a crawl, it takes its chunk budget (it holds KV only progress releases)
    adder = _adder(pool_tokens=100)
    running = _req("r", 10, 1000, adder)
    chunked_adder = _adder_with_running(adder, [running], 1.0)
    assert chunked_adder.rem_total_tokens < 0
    req = _req("c", 100, 4, adder)
    assert chunked_adder.add_chunked_req(req) is req  # still truncated
    assert req.extend_input_len == 32 and len(req.fill_ids) == 32


def test_an_admitted_request_counts_a_hit_on_its_prefix_a_refused_one_does_not() -> None:
    """--radix-eviction-policy lfu counts reuse by admitted requests: the scheduler matches a waiting
    request every time it looks at the queue, and those looks must not count."""
    adder = _adder(pool_tokens=100)
    tree = adder.tree_cache
    tree.insert(list(range(1, 41)), adder.token_to_kv_pool_allocator.alloc(40))
    (node,) = tree.root_node.children.values()
    too_big = _req("a", 50, 60, adder)  # its 40-token prefix matches, but 10 + 60 tokens do not fit
    assert len(too_big.prefix_indices) == 40 and adder.add_one_req(too_big) == AddReqResult.NO_TOKEN
    assert node.hit_count == 0
    fits = _req("b", 45, 4, adder)
    assert adder.add_one_req(fits) == AddReqResult.CONTINUE and fits.last_node is node
    assert node.hit_count == 1
