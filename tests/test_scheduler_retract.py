"""Retraction: a KV pool far too small for the workload still completes every request,
token-identical to a large-pool run, with new_token_ratio raised then decayed (§1.6-1.8)."""

from __future__ import annotations

import random

from minisgl import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}


def _run_all(engine, prompts, max_new, check_every_step=False):
    rids = [engine.add_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": m}) for p, m in zip(prompts, max_new)]
    ratios, retracted = [], 0
    while engine.has_unfinished_requests():
        snap = engine.step()
        ratios.append(snap["new_token_ratio"])
        retracted += sum(e["type"] == "retract" for e in snap["events"])
        if check_every_step:
            engine.scheduler.check_integrity()
    engine.step()  # idle leak check
    return [engine.get_result(r)["output_ids"] for r in rids], ratios, retracted


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
