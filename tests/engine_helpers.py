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
