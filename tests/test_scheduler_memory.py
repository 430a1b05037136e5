"""Memory pressure: radix sharing and eviction, page sizes, integrity after every step."""

from __future__ import annotations

import random

import pytest

from minisgl import Engine

from engine_helpers import GREEDY, run_all as _run_all


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_hits_the_cache_and_matches_a_cache_disabled_run(tiny_model, page_size):
    system = list(range(20, 84))  # 64 shared tokens
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(4)]
    cached = Engine(tiny_model, device="cpu", max_total_tokens=2048, page_size=page_size)
    first = cached.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 5})
    rest = cached.generate(input_ids=prompts[1:], sampling_params={**GREEDY, "max_new_tokens": 5})
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(r["meta_info"]["cached_tokens"] == 64 for r in rest)
    nocache = Engine(tiny_model, device="cpu", max_total_tokens=2048, page_size=page_size, disable_radix_cache=True)
    expected = nocache.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 5})
    assert [first["output_ids"]] + [r["output_ids"] for r in rest] == [e["output_ids"] for e in expected]
    assert all(e["meta_info"]["cached_tokens"] == 0 for e in expected)


def test_eviction_under_pressure_keeps_serving(tiny_model):
    engine = Engine(tiny_model, device="cpu", max_total_tokens=256)
    for i in range(8):  # 8 x ~100 tokens through a 256-token pool: old prefixes must be evicted
        out = engine.generate(input_ids=[10 + i] * 90, sampling_params={**GREEDY, "max_new_tokens": 8})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    load = engine.get_load()
    assert load.evictable_tokens <= 256 and load.available_tokens + load.evictable_tokens == 256


@pytest.mark.parametrize("page_size", [1, 16])
def test_random_workload_integrity_after_every_step(tiny_model, page_size):
    rng = random.Random(page_size)
    shared = [rng.randrange(10, 400) for _ in range(40)]
    prompts, max_new = [], []
    for _ in range(12):
        head = shared[: rng.choice([0, 16, 40])]
        prompts.append(head + [rng.randrange(10, 400) for _ in range(rng.randrange(1, 50))])
        max_new.append(rng.randrange(1, 24))
    engine = Engine(
        tiny_model, device="cpu", max_total_tokens=320, page_size=page_size, chunked_prefill_size=48,
        schedule_policy="lpm", max_running_requests=6,
    )  # fmt: skip
    outs, _, _ = _run_all(engine, prompts, max_new, check_every_step=True)
    assert [len(o) for o in outs] == max_new
    reference = Engine(tiny_model, device="cpu", max_total_tokens=4096, page_size=page_size, disable_radix_cache=True)
    ref_outs, _, _ = _run_all(reference, prompts, max_new)
    assert outs == ref_outs


# Each case killed the scheduler before ("KV cache out of memory", from the chunk's or the
# decode rows' allocation). (4, 64): the decoders sit on a page boundary, and no pass has
# room for their new pages, so they wait for the prefill.
@pytest.mark.parametrize(
    "page_size, chunk, decoders, warm_steps, long_len, rides_along",
    [(1, 12, 3, 1, 44, True), (4, 64, 4, 5, 24, False), (4, 8, 4, 5, 24, True)],
)
def test_mixed_chunks_in_a_tight_pool_finish_every_request(tiny_model, page_size, chunk, decoders, warm_steps, long_len,
                                                           rides_along):  # fmt: skip
    """--enable-mixed-chunk with a pool the decode rows could eat: decoding requests ride
    along only while the KV they take is not what the prefill still needs (page-aware)."""
    engine = Engine(
        tiny_model, device="cpu", max_total_tokens=64, page_size=page_size, chunked_prefill_size=chunk,
        enable_mixed_chunk=True, schedule_conservativeness=0.01,  # admission overcommits on purpose
    )  # fmt: skip
    params = {**GREEDY, "max_new_tokens": 10}
    short = [engine.add_request(input_ids=[10 + i, 20 + i, 30 + i, 40 + i], sampling_params=params) for i in range(decoders)]
    for _ in range(warm_steps):  # they decode ...
        engine.step()
    long = engine.add_request(input_ids=list(range(100, 100 + long_len)), sampling_params={**GREEDY, "max_new_tokens": 1})
    modes = set()
    while engine.has_unfinished_requests():  # ... while a long prompt is prefilled
        modes.add(engine.step()["forward_mode"])
        engine.scheduler.check_integrity()
    assert ("MIXED" in modes) == rides_along
    assert [len(engine.get_result(r)["output_ids"]) for r in short] == [10] * decoders
    assert len(engine.get_result(long)["output_ids"]) == 1
    engine.scheduler.check_memory_when_idle()


@pytest.mark.parametrize("kwargs", [{"max_total_tokens": 6}, {"context_length": 6}])
def test_a_pool_or_context_too_small_for_any_prompt_is_refused_at_start(tiny_model, kwargs):
    """It used to start, then 400 every prompt (or, with auto-truncate, cut prompts to nothing:
    an IndexError in the server, a spin in the Engine)."""
    from minisgl import Engine

    with pytest.raises(ValueError, match="leave no room for a prompt"):
        Engine(tiny_model, device="cpu", allow_auto_truncate=True, **kwargs)


def test_the_integrity_check_sees_a_row_pointing_at_a_freed_slot(tiny_model):
    """The counts balance here; only the row itself shows that its K/V would come from a free page."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=256) as eng:
        rid = eng.add_request(input_ids=list(range(10, 30)), sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 20})
        for _ in range(3):
            eng.step(snapshot=False)
        sched = eng.scheduler
        sched.check_integrity()  # whole so far
        (req,) = [r for r in sched.running_batch.reqs if r.rid == rid]
        free_slot = int(sched.token_to_kv_pool_allocator.free_pages[0]) * sched.page_size
        row = sched.req_to_token_pool.req_to_token[req.req_pool_idx]
        kept = int(row[0])
        row[0] = free_slot
        with pytest.raises(AssertionError, match=f"request {rid}: its req_to_token row points at freed KV slots"):
            sched.check_integrity()
        row[0] = kept  # (so the abort frees what the request really holds)
        sched.check_integrity()
        eng.abort(rid)
        eng.run_until_idle()


def test_batch_full_says_whether_slots_or_kv_tokens_ran_out(tiny_model):
    """After a NO_TOKEN stop, SGLang's batch_is_full holds admission with request slots free;
    the adder record said "running batch is full", pointing a learner at the slots."""
    from minisgl.visualizer.widget import demo_input_ids

    with Engine(tiny_model, device="cpu", chunked_prefill_size=64, max_total_tokens=200, max_running_requests=8) as e:
        for i in range(4):
            e.add_request(input_ids=demo_input_ids(30, i), sampling_params={**GREEDY, "max_new_tokens": 40}, rid=f"r{i}")
        assert e.step()["adder"]["stop_reason"] == "NO_TOKEN"
        adder = e.step()["adder"]
        assert adder["stop_reason"] == "BATCH_FULL" and adder["budgets"]["request_slots_left"] > 0
        assert "ran out of KV tokens (NO_TOKEN)" in adder["stop_detail"]
        e.run_until_idle()
    with Engine(tiny_model, device="cpu", max_total_tokens=2048, max_running_requests=1) as e:
        e.add_request(input_ids=demo_input_ids(8, 0), sampling_params={**GREEDY, "max_new_tokens": 5}, rid="a")
        e.add_request(input_ids=demo_input_ids(8, 1), sampling_params={**GREEDY, "max_new_tokens": 5}, rid="b")
        e.step()
        adder = e.step()["adder"]
        assert adder["stop_reason"] == "BATCH_FULL" and adder["stop_detail"] == "no request slot left (max_running_requests=1)"
        e.run_until_idle()
