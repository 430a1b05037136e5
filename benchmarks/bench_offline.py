"""Offline throughput: how many output tokens per second does minisgl produce, against
Hugging Face transformers on the same weights and requests, and against the FLOPs floor?

The protocol of nano-vllm and mini-sglang: seed 0, N requests, input and output lengths
uniform in [lo, hi], random token ids, ignore_eos (every request generates exactly its
output length). The model is a Qwen3-shaped decoder with random weights that the script
builds (benchmarks/common.py). With `--compare hf` the same process also runs
transformers' static padded `generate` (batches of each --hf-batch-size, 32 and 64 by
default, the faster counting; all 64 requests at once is what minisgl runs) and its continuous
batching (`generate_batch`'s manager, per-request max_new_tokens), and prints ratios.
Every engine gets the same untimed warm-up (the first prompt's first 32 tokens, 4 new
ones). Hugging Face runs first, in the process as a user would have it: minisgl's ModelRunner
changes glibc's malloc thresholds process-wide on the CPU (docs/model_execution.md), and
HF running after it would measure a process that HF on its own does not set up.

    python benchmarks/bench_offline.py                 # minisgl only, the default workload
    python benchmarks/bench_offline.py --compare hf    # + both HF paths (several minutes)
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import Any, Dict, List

import common


def run_minisgl(
    model_path: str, input_ids: List[List[int]], output_lens: List[int], args: argparse.Namespace, publish: bool = False
) -> Dict[str, Any]:
    """All requests queued at once, then step() to idle; each step timed and classified.

    `publish=True` adds what `minisgl serve --visualize` adds to every scheduler step:
    build the snapshot, JSON-encode it and send it NOBLOCK on a ZMQ PUB socket.
    """
    from minisgl import Engine

    engine = Engine(model_path, **_engine_kwargs(args))
    publisher = SnapshotPublisher() if publish else None
    # warm-up: one short request so allocator and kernels are warm
    engine.generate(input_ids=[input_ids[0][:32]], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    graphs = engine.model_runner.cuda_graph_runner  # (None off CUDA or with --disable-cuda-graph)
    replays_before = graphs.num_replays if graphs is not None else 0
    t_start = time.perf_counter()
    for ids, out_len in zip(input_ids, output_lens):
        engine.add_request(input_ids=ids, sampling_params={"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0.0})
    prefill_s = decode_s = 0.0
    decode_steps: Dict[int, List[float]] = {}  # batch size -> step seconds
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step(snapshot=False)
        if publisher is not None:
            publisher.publish(engine)
        dt = time.perf_counter() - t0
        batch = engine.scheduler.cur_batch
        if batch is None:
            continue
        if batch.forward_mode.is_decode():
            decode_s += dt
            decode_steps.setdefault(batch.batch_size(), []).append(dt)
        else:
            prefill_s += dt
    wall = time.perf_counter() - t_start
    results = [engine.get_result(rid) for rid in list(engine.rid_to_state)]
    got = sorted(len(r["output_ids"]) for r in results)
    if got != sorted(output_lens):
        raise RuntimeError("minisgl produced different output lengths than requested (ignore_eos broken?)")
    graph_replays = graphs.num_replays - replays_before if graphs is not None else 0
    engine.shutdown()
    if publisher is not None:
        publisher.close()
    return {"wall": wall, "prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": decode_steps, "graph_replays": graph_replays}


class SnapshotPublisher:
    """The scheduler process's --visualize path (managers/scheduler.py event_loop_normal)."""

    def __init__(self) -> None:
        import tempfile

        import zmq

        self.dir = tempfile.mkdtemp(prefix="minisgl-bench-")
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 1024)
        self.sock.bind(f"ipc://{self.dir}/visualizer")

    def publish(self, engine: Any) -> None:
        import json

        import zmq

        from minisgl.managers.io_struct import SchedulerSnapshotOut, encode

        msg = SchedulerSnapshotOut(engine.scheduler.forward_ct, json.dumps(engine.snapshot()))
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        import shutil

        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _engine_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    for name in ("max_running_requests", "chunked_prefill_size", "max_total_tokens", "kv_cache_dtype"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.enable_mixed_chunk:
        kw["enable_mixed_chunk"] = True
    if args.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    return kw


def run_hf_static(model: Any, input_ids: List[List[int]], output_lens: List[int], batch_size: int) -> float:
    """transformers `generate` on left-padded batches; each batch runs to its longest output."""
    import torch

    t0 = time.perf_counter()
    for start in range(0, len(input_ids), batch_size):
        ids, outs = input_ids[start : start + batch_size], output_lens[start : start + batch_size]
        width = max(len(x) for x in ids)
        tokens = torch.tensor([[0] * (width - len(x)) + x for x in ids])  # [bs, width], pad id 0 on the left
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
        with torch.inference_mode():
            out = model.generate(
                input_ids=tokens.to(model.device), attention_mask=mask.to(model.device),
                max_new_tokens=max(outs), min_new_tokens=max(outs),
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        if out.shape[1] - width != max(outs):  # every request's tokens are in it, or the rate is wrong
            raise RuntimeError(f"HF generate produced {out.shape[1] - width} tokens per row, asked {max(outs)}")
    return time.perf_counter() - t0


def run_hf_continuous(model: Any, input_ids: List[List[int]], output_lens: List[int], args: argparse.Namespace) -> float:
    """transformers continuous batching with each request's own max_new_tokens and no EOS."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    total = sum(len(x) + o for x, o in zip(input_ids, output_lens))
    # the KV page size is `page_size` since transformers 5.2x, `block_size` before (5.17 has only that)
    page_field = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cbc = ContinuousBatchingConfig(
        **{page_field: 64}, num_blocks=total // 64 + 2 * len(input_ids) + 8,
        max_batch_tokens=args.hf_max_batch_tokens, max_requests_per_batch=len(input_ids),
    )  # fmt: skip
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    try:
        # warm-up, as minisgl's: the first forward of a process is not part of the workload
        mgr.add_request(input_ids[0][:32], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        while True:
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                break
            if r is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        t0 = time.perf_counter()
        for i, (ids, out_len) in enumerate(zip(input_ids, output_lens)):
            mgr.add_request(ids, request_id=f"r{i}", max_new_tokens=out_len, eos_token_id=-1)
        done: Dict[str, int] = {}
        while len(done) < len(input_ids):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = len(r.generated_tokens)
            elif r is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True)
    if sum(done.values()) != sum(output_lens):  # the rate divides the requested count: it must be the produced one
        raise RuntimeError(f"HF continuous batching produced {sum(done.values())} tokens, asked {sum(output_lens)}")
    return wall


def report_decode_floor(run: Dict[str, Any], shape: common.ModelShape, args: argparse.Namespace) -> None:
    """The median decode step at the target batch (or the largest seen) vs 2*P*bs / matmul rate."""
    steps = run["decode_steps"]
    if not steps:
        return
    bs = args.decode_batch if args.decode_batch in steps else max(steps)
    step_s = statistics.median(steps[bs])
    rate = common.matmul_rate(shape, bs, args.dtype, args.device)
    floor_s = 2.0 * shape.matmul_params() * bs / rate
    common.print_result("decode_step_batch", bs, "reqs", f"{len(steps[bs])} steps at this batch size")
    common.print_result("decode_step_ms", step_s * 1e3, "ms")
    common.print_result("decode_step_floor_ms", floor_s * 1e3, "ms", f"2*P*bs at {rate / 1e9:.0f} GFLOP/s (m={bs})")
    common.print_result("decode_step_vs_floor", step_s / floor_s, "x", "target <= 2")
    # The same floor with every layer's own weights streamed from memory, as the model must (common.matmul_rate).
    streamed = common.matmul_rate(shape, bs, args.dtype, args.device, every_layer=True)
    streamed_s = 2.0 * shape.matmul_params() * bs / streamed
    common.print_result("decode_step_floor_streamed_ms", streamed_s * 1e3, "ms",
                        f"every layer's own weights: {streamed / 1e9:.0f} GFLOP/s (m={bs})")  # fmt: skip
    common.print_result("decode_step_vs_floor_streamed", step_s / streamed_s, "x",
                        "for reference; the target uses the line above")  # fmt: skip
    if args.device == "cuda":
        import torch

        bytes_per_step = shape.matmul_params() * torch.finfo(getattr(torch, args.dtype)).bits // 8
        bw = common.copy_bandwidth("cuda")
        common.print_result("decode_weight_GBps", bytes_per_step / step_s / 1e9, "GB/s", f"device copy {bw / 1e9:.0f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 512), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    common.add_runtime_args(p)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--enable-mixed-chunk", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: minisgl runs decode steps eagerly (no graph replays).")
    p.add_argument("--kv-cache-dtype", default=None, help="minisgl's KV pool dtype (auto or bfloat16; default auto).")
    p.add_argument("--decode-batch", type=int, default=64, help="Batch size at which the decode step is compared to its floor.")
    p.add_argument("--compare", choices=("none", "hf"), default="none")
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[32, 64],
                   help="Static batch sizes of HF generate; each is timed and the fastest is HF static's number.")
    p.add_argument("--hf-max-batch-tokens", type=int, default=2048)
    p.add_argument("--visualize-overhead", action="store_true",
                   help="Run minisgl again publishing a snapshot every step, as --visualize does; report the cost.")
    args = p.parse_args()
    common.apply_runtime_args(args)

    model_path, shape = common.model_from_args(args)
    input_ids, output_lens = common.random_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), shape.vocab, args.seed)
    n_in, n_out = sum(map(len, input_ids)), sum(output_lens)
    common.print_header(
        "offline throughput (minisgl vs transformers)",
        {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
         "input_tokens": n_in, "output_tokens": n_out, "seed": args.seed, "ignore_eos": True},
        {"model": model_path, "params": shape.matmul_params(), "device": args.device, "dtype": args.dtype,
         "engine": _engine_kwargs(args), "compare": args.compare},
    )  # fmt: skip

    hf = run_hf(model_path, input_ids, output_lens, args) if args.compare == "hf" else None

    run = run_minisgl(model_path, input_ids, output_lens, args)
    tps = n_out / run["wall"]
    common.print_result("minisgl_output_tok_s", tps, "tok/s", f"wall {run['wall']:.2f} s")
    common.print_result("minisgl_total_tok_s", (n_in + n_out) / run["wall"], "tok/s")
    common.print_result("minisgl_prefill_tok_s", n_in / max(run["prefill_s"], 1e-9), "tok/s", f"{run['prefill_s']:.2f} s in prefill steps")
    common.print_result("minisgl_decode_tok_s", (n_out - args.num_requests) / max(run["decode_s"], 1e-9), "tok/s", f"{run['decode_s']:.2f} s in decode steps")
    if args.device == "cuda":
        steps = sum(len(v) for v in run["decode_steps"].values())
        common.print_result("decode_graph_replays", run["graph_replays"], "steps", f"of {steps} decode steps replayed a CUDA graph")

    rate = common.matmul_rate(shape, 512, args.dtype, args.device)
    floor_wall = shape.workload_flops(n_in, n_out, args.num_requests) / rate
    common.print_result("matmul_rate_gflops", rate / 1e9, "GFLOP/s", "model's matmuls at 512 rows")
    common.print_result("floor_output_tok_s", n_out / floor_wall, "tok/s", "the workload's matmul FLOPs at that rate")
    common.print_result("minisgl_vs_floor", tps / (n_out / floor_wall), "x", "target >= 0.5")
    report_decode_floor(run, shape, args)

    if args.visualize_overhead:
        vis = run_minisgl(model_path, input_ids, output_lens, args, publish=True)
        common.print_result("minisgl_visualize_output_tok_s", n_out / vis["wall"], "tok/s", "snapshot + JSON + PUB every step")
        common.print_result("visualize_overhead_pct", (vis["wall"] / run["wall"] - 1) * 100, "%", "target < 5")

    if hf is not None:
        best = n_out / min(hf)
        common.print_result("minisgl_vs_best_hf", tps / best, "x", "target >= 4")


def run_hf(model_path: str, input_ids: List[List[int]], output_lens: List[int], args: argparse.Namespace) -> tuple[float, float]:
    """Both HF paths on the same weights and requests; returns (static wall s, continuous batching wall s)."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    n_out = sum(output_lens)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    run_hf_static(model, [input_ids[0][:32]], [4], 1)  # warm-up, as minisgl's (the first forward is slow)
    walls = {}
    for bs in args.hf_batch_size:
        walls[bs] = run_hf_static(model, input_ids, output_lens, bs)
        common.print_result(f"hf_static_bs{bs}_output_tok_s", n_out / walls[bs], "tok/s", f"padded batches of {bs}, wall {walls[bs]:.2f} s")
    best_bs = min(walls, key=walls.get)
    static_s = walls[best_bs]
    common.print_result("hf_static_output_tok_s", n_out / static_s, "tok/s", f"useful tokens, the best batch size ({best_bs})")
    cb_s = run_hf_continuous(model, input_ids, output_lens, args)
    common.print_result("hf_cb_output_tok_s", n_out / cb_s, "tok/s", f"generate_batch manager, wall {cb_s:.2f} s")
    del model
    gc.collect()
    return static_s, cb_s


if __name__ == "__main__":
    main()
