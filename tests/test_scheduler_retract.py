"""Retraction: a KV pool far too small for the workload still completes every request,
token-identical to a large-pool run, with new_token_ratio raised then decayed (§1.6-1.8)."""

from __future__ import annotations

import random

import pytest

from minisgl import Engine

from engine_helpers import GREEDY, run_all as _run_all


def test_retraction_completes_a_workload_ten_times_the_pool(tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(12)] for _ in range(64)]
    # ~2000 tokens of demand for a 200-token pool; varied lengths so requests finish at
    # different times and new ones are admitted while others still grow
    max_new = [rng.randrange(4, 36) for _ in range(64)]
    # a low schedule_conservativeness (initial new_token_ratio 0.07) makes admission
    # overcommit on purpose, so running requests outgrow the pool and must be retracted
    small = Engine(tiny_model, device="cpu", max_total_tokens=200, chunked_prefill_size=-1, schedule_conservativeness=0.1)
    outs_small, ratios, retracted = _run_all(small, prompts, max_new)
    big = Engine(tiny_model, device="cpu", max_total_tokens=4096, chunked_prefill_size=-1)
    outs_big, _, big_retracted = _run_all(big, prompts, max_new)
    assert retracted > 0 and big_retracted == 0
    assert outs_small == outs_big
    peak = max(range(len(ratios)), key=lambda i: ratios[i])
    assert ratios[peak] > small.scheduler.init_new_token_ratio  # raised by retraction ...
    assert min(ratios[peak:]) < ratios[peak]  # ... then decayed step by step
    assert small.get_load().num_retracted_reqs_total == retracted
    # idle again after the last step: the ratio is back at its start (§1.8), so the next burst
    # is admitted as boldly as the first, without any step taken while idle
    assert small.scheduler.new_token_ratio == small.scheduler.init_new_token_ratio


def test_a_request_bigger_than_the_pool_fails_clearly_and_others_run(tiny_model):
    # The pool, not the context, is the limit here: SGLang's max_req_len = min(context - 1,
    # pool - 1) turns an impossible request into a clear 400 (prompt: the front gate checks the
    # scheduler's max_req_input_len) or a clamped max_new_tokens (output), never a scheduler
    # crash or a hang.
    engine = Engine(tiny_model, device="cpu", max_total_tokens=64, chunked_prefill_size=-1)
    with pytest.raises(ValueError, match=r"The input \(100 tokens\) is longer than this server accepts \(57 tokens"):
        engine.add_request(input_ids=list(range(10, 110)), sampling_params={**GREEDY, "max_new_tokens": 4})
    clamped = engine.add_request(input_ids=list(range(10, 50)), sampling_params={**GREEDY, "max_new_tokens": 500})
    ok = engine.add_request(input_ids=list(range(10, 20)), sampling_params={**GREEDY, "max_new_tokens": 4})
    engine.run_until_idle()
    out = engine.get_result(clamped)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 40 + len(out["output_ids"]) <= 64  # the whole request fits the pool
    assert len(engine.get_result(ok)["output_ids"]) == 4
    engine.scheduler.check_memory_when_idle()


def test_a_request_aborted_while_running_and_then_retracted_ends_at_once(tiny_model):
    """An abort marks a running request (it ends after its next forward); if that step
    retracts it instead, it must end there, not go back to the queue to be prefilled again
    only to finish (the client waited through a whole re-prefill for its abort)."""
    engine = Engine(tiny_model, device="cpu", max_total_tokens=64, chunked_prefill_size=-1, schedule_conservativeness=0.01)
    params = {**GREEDY, "ignore_eos": True, "max_new_tokens": 40}
    a = engine.add_request(input_ids=list(range(10, 20)), sampling_params=params)
    engine.step(snapshot=False)
    b = engine.add_request(input_ids=list(range(30, 40)), sampling_params=params)
    sched = engine.scheduler
    for _ in range(200):  # decode both until the next step has to retract one of them
        batch = sched.running_batch
        if batch.batch_size() == 2 and batch.forward_mode.is_decode() and not batch.check_decode_mem():
            break
        engine.step(snapshot=False)
    else:
        pytest.fail("the pool never filled up")
    decoded = {r.rid: len(r.output_ids) for r in batch.reqs}
    engine.abort(a)
    engine.abort(b)
    engine.step(snapshot=False)  # retracts one, runs the other's last forward
    assert sched.num_retracted_reqs_total == 1
    assert sched.waiting_queue == [] and not engine.has_unfinished_requests()
    for rid in (a, b):
        out = engine.get_result(rid)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) == decoded[rid]  # what it had decoded, nothing lost or added
    engine.scheduler.check_memory_when_idle()
