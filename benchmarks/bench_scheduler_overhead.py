"""Scheduler overhead: how much of a decode step is spent outside the model?

For each (model, running requests) point, N requests with short prompts are brought
into steady decode on an in-process Engine, then --steps decode steps are timed. The
ModelRunner's `forward` and `sample` are wrapped with timers, so each step splits into
    model     = forward + sample (the work a faster kernel would shrink)
    scheduler = Scheduler.run_step minus model (batch building, tree and pool bookkeeping,
                result processing, output assembly)
    engine    = Engine.step minus run_step (detokenization, result handling, snapshot())
overhead = scheduler + engine, reported as a share of the step (target < 10% at 64
running requests on the 30M model). The tiny model (1 layer, hidden 64) makes the
model nearly free, so its step time is almost all overhead: the per-request cost.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any, Callable, Dict, List

import common

TINY = common.ModelShape(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, inter=256, vocab=4096, max_pos=2048)


def _timed(fn: Callable[..., Any], acc: List[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        acc.append(time.perf_counter() - t0)
        return out

    return wrapper


def measure(model_path: str, vocab: int, num_reqs: int, args: argparse.Namespace) -> Dict[str, float]:
    """Median per-step seconds of each part over --steps steady decode steps at `num_reqs`."""
    from minisgl import Engine

    # a finite max_new_tokens keeps the admission reservation small, so all num_reqs fit at once
    max_new_tokens = args.steps + 32
    engine = Engine(model_path, device=args.device, dtype=args.dtype, max_running_requests=num_reqs,
                    max_total_tokens=2 * num_reqs * (args.input_len + max_new_tokens) + 1024)  # fmt: skip
    ids, _ = common.random_requests(num_reqs, (args.input_len,) * 2, (1, 1), vocab, seed=0)
    for x in ids:
        engine.add_request(input_ids=x, sampling_params={"max_new_tokens": max_new_tokens, "ignore_eos": True})
    runner, sched = engine.model_runner, engine.scheduler
    while not (sched.cur_batch is not None and sched.cur_batch.forward_mode.is_decode() and sched.cur_batch.batch_size() == num_reqs):
        engine.step()
    fwd: List[float] = []
    smp: List[float] = []
    run: List[float] = []
    runner.forward = _timed(runner.forward, fwd)  # type: ignore[method-assign]
    runner.sample = _timed(runner.sample, smp)  # type: ignore[method-assign]
    sched.run_step = _timed(sched.run_step, run)  # type: ignore[method-assign]
    steps: List[float] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    engine.shutdown()
    model = [f + s for f, s in zip(fwd, smp)]
    return {
        "step": statistics.median(steps),
        "model": statistics.median(model),
        "scheduler": statistics.median(r - m for r, m in zip(run, model)),
        "engine": statistics.median(s - r for s, r in zip(steps, run)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_runtime_args(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=(1, 64, 256), help="Running requests, tiny model.")
    p.add_argument("--target-batch", type=int, default=64, help="Running requests on the --hidden/--layers model.")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-target-model", action="store_true", help="Only the tiny model.")
    args = p.parse_args()
    common.apply_runtime_args(args)
    tiny_path = common.build_model(TINY, args.model_cache)
    points = [("tiny", tiny_path, TINY, bs) for bs in args.batch_sizes]
    if not args.skip_target_model:
        path, shape = common.model_from_args(args, flops_floor=False)
        points.append(("model", path, shape, args.target_batch))
    common.print_header(
        "scheduler overhead per decode step",
        {"input_len": args.input_len, "steps": args.steps, "points": [(n, bs) for n, _, _, bs in points]},
        {"models": {n: {"path": path, "params": common.params_label(path, s)} for n, path, s, _ in points},
         "device": args.device, "dtype": args.dtype},
    )  # fmt: skip
    for name, path, shape, bs in points:
        r = measure(path, shape.vocab, bs, args)
        tag = f"{name}_bs{bs}"
        common.print_result(f"{tag}_step_ms", r["step"] * 1e3, "ms")
        common.print_result(f"{tag}_model_ms", r["model"] * 1e3, "ms", "forward + sample")
        common.print_result(f"{tag}_scheduler_ms", r["scheduler"] * 1e3, "ms", "run_step outside the model")
        common.print_result(f"{tag}_engine_ms", r["engine"] * 1e3, "ms", "detokenize + results + snapshot")
        share = (r["scheduler"] + r["engine"]) / r["step"]
        common.print_result(f"{tag}_overhead_share", share, "", "target < 0.10" if name == "model" else "")


if __name__ == "__main__":
    main()
