"""Helpers shared by the scheduler tests that drive an Engine to completion."""

from __future__ import annotations

from typing import Any, List, Tuple

GREEDY = {"temperature": 0, "ignore_eos": True}


def run_all(engine: Any, prompts: List[List[int]], max_new: List[int], check_every_step: bool = False) -> Tuple[List[List[int]], List[float], int]:
    """Submit every prompt, step to idle; returns (output ids per request, new_token_ratio per step, #retractions).

    The last step, which leaves the scheduler idle, runs its leak check (available +
    evictable + protected == total) and resets new_token_ratio.
    """
    rids = [engine.add_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": m}) for p, m in zip(prompts, max_new)]
    ratios, retracted = [], 0
    while engine.has_unfinished_requests():
        snap = engine.step()
        ratios.append(snap["new_token_ratio"])
        retracted += sum(e["type"] == "retract" for e in snap["events"])
        if check_every_step:
            engine.scheduler.check_integrity()
    return [engine.get_result(r)["output_ids"] for r in rids], ratios, retracted


def assert_shutdown_frees_the_kv_pool(engine: Any) -> None:
    """Engine.shutdown() frees the KV pool by reference counting alone: with the cycle collector
    off, a reference cycle through the pool (the backend's metadata, the CUDA-graph runner) would
    keep it, and on a GPU a second Engine would find no memory."""
    import gc
    import weakref

    kv = weakref.ref(engine.model_runner.token_to_kv_pool.k_buffer[0])
    gc.collect()
    gc.disable()
    try:
        engine.shutdown()
        assert kv() is None, "the KV pool outlived Engine.shutdown()"
    finally:
        gc.enable()
