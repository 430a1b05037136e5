"""What does NGRAM speculative decoding (--speculative-algorithm NGRAM) buy on this machine?

The same greedy, ignore_eos requests run with speculation off (the baseline) and on, one engine
after the other in this process, each warmed up outside the timing, at several batch sizes and
draft lengths (--speculative-num-draft-tokens, default 4). Per point it prints output tok/s, the
ratio on/off, the accept length (completion tokens per decoding pass: meta_info's
spec_accept_length, weighted by each request's spec_verify_ct), the decode passes taken (decode and
verify steps, the scheduler's forward_ct_decode), the mean time of one such pass, and how many
outputs are identical to the baseline's (all must be: speculation never changes a greedy output).

Workloads (docs/benchmarks.md, "Speculative decoding"):
  loop   the random-weight model (benchmarks/common.py; --model or the shape flags), random prompts:
         its greedy output falls into short loops, which the n-gram drafts predict (best case)
  quote  the built-in model (--text-model), a passage of its training text given twice and started
         a third time: real text that repeats, which a capable model would copy
  text   the built-in model, the first tokens of a passage: free prose, little to copy

Where it sits: a standalone script; drives minisgl.Engine step by step (add_request, step) so that
each pass is timed; prints `RESULT <workload>_bs<b>_<config>_<metric> <value>` lines.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import common

WORKLOADS = ("loop", "quote", "text")
BUILTIN = "builtin"


@dataclass
class Run:
    """One configuration on one workload at one batch size."""

    wall: float  # seconds, every step of every round (prefill included)
    passes: int  # decode + verify steps
    pass_s: float  # seconds spent in those steps
    outputs: List[List[int]]
    verify_ct: int  # decoding passes summed over requests (meta_info spec_verify_ct)
    verify_tokens: float  # completion tokens (spec_accept_length x spec_verify_ct)


def build_prompts(workload: str, tokenizer: Any, n: int, args: argparse.Namespace, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    if workload == "loop":
        lo, hi = args.prompt_len
        return [[rng.randint(3, tokenizer.vocab_size - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    # Python's reference docs: the built-in model's training text (docs/builtin_model.md), in CPython
    import pydoc_data.topics

    topics = sorted(t for t in pydoc_data.topics.topics.values() if len(t) > 4 * args.passage_len)
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(topics[rng.randrange(len(topics))], add_special_tokens=False)
        start = rng.randint(0, max(0, len(ids) - args.passage_len))
        passage = ids[start : start + args.passage_len]
        # quote: the passage twice, then its first quarter: the continuation is in the prompt
        prompts.append(passage + passage + passage[: args.passage_len // 4] if workload == "quote" else passage)
    return prompts


def run_rounds(engine: Any, prompts: List[List[int]], batch: int, output_len: int) -> Run:
    """`batch` requests at a time, all arriving together, stepped until they finish, each step
    timed; a step that advanced the scheduler's forward_ct_decode was a decode or verify pass."""
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    scheduler = engine.scheduler
    wall = pass_s = 0.0
    passes = verify_ct = 0
    verify_tokens = 0.0
    outputs: List[List[int]] = []
    for i in range(0, len(prompts), batch):
        engine.flush_cache()  # each round prefills in full, as the baseline's did
        rids = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts[i : i + batch]]
        while engine.has_unfinished_requests():
            before = scheduler.forward_ct_decode
            t0 = time.perf_counter()
            engine.step(snapshot=False)
            dt = time.perf_counter() - t0
            wall += dt
            if scheduler.forward_ct_decode > before:
                passes += 1
                pass_s += dt
        for rid in rids:
            result = engine.get_result(rid)
            outputs.append(result["output_ids"])
            meta = result["meta_info"]
            verify_ct += meta.get("spec_verify_ct", 0)
            verify_tokens += (meta.get("spec_accept_length") or 0.0) * meta.get("spec_verify_ct", 0)  # (None: no pass)
    return Run(wall, passes, pass_s, outputs, verify_ct, verify_tokens)


CUDA_POOL_TOKENS = 1 << 17


def engine_kwargs(args: argparse.Namespace, num_draft: Optional[int]) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    if args.device == "cuda":
        # the engines are alive at once (measure_model): on a GPU each would size its KV pool from
        # the memory left free (--mem-fraction-static), so the first took nearly all of it and the
        # next found none; the workload needs a few thousand tokens per engine
        kw["max_total_tokens"] = CUDA_POOL_TOKENS
    if num_draft is not None:
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=num_draft,
                  speculative_ngram_min_match_window_size=args.min_window,
                  speculative_ngram_max_match_window_size=args.max_window)  # fmt: skip
    return kw


def measure_model(model: Optional[str], workloads: List[str], args: argparse.Namespace) -> Dict[tuple, Run]:
    """Every configuration (off, then each draft length) on this model's workloads and batch sizes:
    one engine per configuration, all alive at once and warmed up; then --repeats times, each point
    runs on every engine in turn, and each configuration keeps its median run. The machine is shared
    and noisy: interleaved, a slow spell hits every configuration of a point alike, where running
    one configuration after the other gave ratios of 0.5x-2.5x for identical passes."""
    from minisgl import Engine

    configs = {"off" if k is None else f"ngram{k}": Engine(model, **engine_kwargs(args, k)) for k in [None, *args.num_draft_tokens]}
    try:
        for engine in configs.values():
            # warm-up outside the timing (heap growth, first calls, oneDNN primitives per row count):
            # the largest batch once, on prompts of another seed, a few tokens each
            for w in workloads:
                warm = build_prompts(w, engine.tokenizer, max(args.batch_sizes), args, seed=99)
                run_rounds(engine, warm, max(args.batch_sizes), min(8, args.output_len))
        tokenizer = next(iter(configs.values())).tokenizer
        samples: Dict[tuple, List[Run]] = {}
        for _ in range(args.repeats):
            for w in workloads:
                for b in args.batch_sizes:
                    n = max(b, args.min_requests // b * b)  # whole rounds of b requests
                    prompts = build_prompts(w, tokenizer, n, args, seed=WORKLOADS.index(w))
                    for config, engine in configs.items():
                        samples.setdefault((w, b, config), []).append(run_rounds(engine, prompts, b, args.output_len))
    finally:
        for engine in configs.values():
            engine.shutdown()
    return {key: sorted(runs, key=lambda r: r.wall)[len(runs) // 2] for key, runs in samples.items()}


def report(runs: Dict[tuple, Run], workloads: List[str], args: argparse.Namespace) -> None:
    configs = [f"ngram{k}" for k in args.num_draft_tokens]
    for w in workloads:
        for b in args.batch_sizes:
            off = runs[(w, b, "off")]
            n_out = len(off.outputs) * args.output_len
            tag = f"{w}_bs{b}"
            common.print_result(f"{tag}_off_output_tok_s", n_out / off.wall, "tok/s", f"wall {off.wall:.2f} s (median of {args.repeats}), {len(off.outputs)} requests")
            common.print_result(f"{tag}_off_decode_passes", off.passes)
            common.print_result(f"{tag}_off_pass_ms", 1e3 * off.pass_s / off.passes, "ms", "mean decode step")
            for c in configs:
                on = runs[(w, b, c)]
                same = sum(a == o for a, o in zip(on.outputs, off.outputs))
                accept = on.verify_tokens / on.verify_ct if on.verify_ct else 1.0
                common.print_result(f"{tag}_{c}_output_tok_s", n_out / on.wall, "tok/s", f"wall {on.wall:.2f} s")
                common.print_result(f"{tag}_{c}_vs_off", off.wall / on.wall, "x", "output tok/s on / off")
                common.print_result(f"{tag}_{c}_accept_len", accept, "", f"completion tokens per request per decoding pass ({on.verify_ct} request-passes)")
                common.print_result(f"{tag}_{c}_decode_passes", on.passes, "", f"off: {off.passes}")
                common.print_result(f"{tag}_{c}_pass_ms", 1e3 * on.pass_s / on.passes, "ms", "mean decode or verify step")
                common.print_result(f"{tag}_{c}_same_outputs", same / len(off.outputs), "", f"{same} of {len(off.outputs)} greedy outputs identical")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_runtime_args(p)
    p.add_argument("--text-model", default=BUILTIN, help="Model of the quote and text workloads (default: the built-in model).")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--min-requests", type=int, default=4, help="Requests per point at least (whole rounds of the batch size).")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("LO", "HI"), help="loop workload")
    p.add_argument("--passage-len", type=int, default=64, help="quote and text workloads")
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[2, 4, 8],
                   help="--speculative-num-draft-tokens values to run (each one engine; 4 is the default)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="Runs of every point, interleaved across the configurations; the median is reported.")
    p.add_argument("--min-window", type=int, default=1, help="--speculative-ngram-min-match-window-size")
    p.add_argument("--max-window", type=int, default=12, help="--speculative-ngram-max-match-window-size")
    args = p.parse_args()
    if min(args.batch_sizes) < 1 or args.output_len < 2 or args.repeats < 1:
        p.error("--batch-sizes and --repeats must be >= 1 and --output-len >= 2 (the first token comes from the prefill)")
    common.apply_runtime_args(args)

    loop = "loop" in args.workloads
    model_path, shape = common.model_from_args(args, flops_floor=False) if loop else (None, None)
    text_workloads = [w for w in args.workloads if w != "loop"]
    text_model = None if args.text_model == BUILTIN else args.text_model
    common.print_header(
        "NGRAM speculative decoding, on and off, greedy",
        {"workloads": args.workloads, "batch_sizes": args.batch_sizes, "min_requests": args.min_requests,
         "output_len": args.output_len, "loop_prompt_len": args.prompt_len, "passage_len": args.passage_len,
         "greedy": True, "ignore_eos": True},
        {"loop_model": model_path, "loop_params": common.params_label(model_path, shape) if loop else None,
         "text_model": args.text_model if text_workloads else None, "device": args.device, "dtype": args.dtype,
         "num_draft_tokens": args.num_draft_tokens, "ngram_window": [args.min_window, args.max_window]},
    )  # fmt: skip
    runs: Dict[tuple, Run] = {}
    if loop:
        runs.update(measure_model(model_path, ["loop"], args))
    if text_workloads:
        runs.update(measure_model(text_model, text_workloads, args))
    report(runs, args.workloads, args)


if __name__ == "__main__":
    main()
