"""Prefix (radix) cache on a few-shot workload: what does reusing a shared prompt buy?

Workload: every request is the same long few-shot prefix (--prefix-len tokens) followed
by its own question (--question-len tokens) and generates --output-len tokens, greedy.
One request runs first (the prefix reaches the cache the way a system prompt does in
service), then the other --num-requests arrive at once. Both runs (radix cache on, and
--disable-radix-cache as the baseline) execute the same requests in the same process;
the script reports throughput, TTFT, the cache hit rate, and checks the outputs match.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import common


def run(model_path: str, prompts: List[List[int]], args: argparse.Namespace, disable_radix_cache: bool) -> Dict[str, Any]:
    from minisgl import Engine

    engine = Engine(model_path, device=args.device, dtype=args.dtype, disable_radix_cache=disable_radix_cache)
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0}
    # Warm up outside the timing (heap growth, first-call costs), with a prompt that shares
    # nothing with the workload, then empty the cache: both configurations start warm and equal.
    (warm,), _ = common.random_requests(1, (len(prompts[0]),) * 2, (1, 1), max(max(p) for p in prompts) + 1, seed=3)
    engine.generate(input_ids=warm, sampling_params=params)
    engine.flush_cache()
    t0 = time.perf_counter()
    first = engine.generate(input_ids=prompts[0], sampling_params=params)
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    wall = time.perf_counter() - t0
    engine.shutdown()
    results = [first, *rest]
    return {
        "wall": wall,
        "outputs": [r["output_ids"] for r in results],
        "ttft": [r["meta_info"]["ttft"] for r in rest],
        "cached": sum(r["meta_info"]["cached_tokens"] for r in results),
        "prompt": sum(r["meta_info"]["prompt_tokens"] for r in results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_runtime_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()
    common.apply_runtime_args(args)
    model_path, shape = common.model_from_args(args, flops_floor=False)

    (prefix,), _ = common.random_requests(1, (args.prefix_len,) * 2, (1, 1), shape.vocab, seed=0)
    questions, _ = common.random_requests(args.num_requests + 1, tuple(args.question_len), (1, 1), shape.vocab, seed=1)
    prompts = [prefix + q for q in questions]
    common.print_header(
        "prefix cache on a shared-prefix (few-shot) workload",
        {"num_requests": args.num_requests + 1, "prefix_len": args.prefix_len, "question_len": args.question_len,
         "output_len": args.output_len, "prompt_tokens": sum(map(len, prompts)), "greedy": True},
        {"model": model_path, "params": common.params_label(model_path, shape), "device": args.device, "dtype": args.dtype},
    )  # fmt: skip
    runs = {"cache_off": run(model_path, prompts, args, True), "cache_on": run(model_path, prompts, args, False)}
    n_out = len(prompts) * args.output_len
    for name, r in runs.items():
        common.print_result(f"{name}_output_tok_s", n_out / r["wall"], "tok/s", f"wall {r['wall']:.2f} s")
        common.print_result(f"{name}_req_s", len(prompts) / r["wall"], "req/s")
        common.print_latency(f"{name}_ttft", r["ttft"])
        common.print_result(f"{name}_hit_rate", r["cached"] / r["prompt"], "", f"{r['cached']} of {r['prompt']} prompt tokens from cache")
    common.print_result("cache_on_vs_off_throughput", runs["cache_off"]["wall"] / runs["cache_on"]["wall"], "x", "target >= 2")
    same = sum(a == b for a, b in zip(runs["cache_on"]["outputs"], runs["cache_off"]["outputs"]))
    common.print_result("same_outputs", same / len(prompts), "", f"{same} of {len(prompts)} greedy outputs identical")


if __name__ == "__main__":
    main()
