"""Chunked prefill and decode latency (seed 002's claim, measured).

Question: while 16 requests decode, one 4,000-token prompt arrives. How long do the
decoding requests wait between tokens (inter-token latency, p50 and p99)?

Configurations, each on a fresh in-process Engine with the same model and requests:
chunked prefill off (-1), 256 and 1024 without mixing, 256 and 1024 with
--enable-mixed-chunk. The ITL window is the same shape in every run: --pre-steps steady
decode steps, then the long prompt's whole prefill, then --post-steps decode steps.
The baseline is "off", measured in the same run; ratios are printed against it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import common

def measure(model_path: str, chunk: int, mixed: bool, args: argparse.Namespace, vocab: int) -> Dict[str, Any]:
    """Inter-token gaps (seconds) of the decoding requests across the long prompt's prefill."""
    from minisgl import Engine

    engine = Engine(model_path, device=args.device, dtype=args.dtype, chunked_prefill_size=chunk, enable_mixed_chunk=mixed)
    decode_ids, _ = common.random_requests(args.num_decode, (args.decode_input_len,) * 2, (1, 1), vocab, seed=1)
    (long_ids,), _ = common.random_requests(1, (args.long_len,) * 2, (1, 1), vocab, seed=2)
    # Decoders must outlive the window (pre steps + one step per chunk, at worst one per
    # token, + post steps), but not by much: admission reserves each request's
    # max_new_tokens (SGLang's PrefillAdder), and a huge value would keep the running
    # batch "full" so the long prompt could never be admitted.
    window = args.pre_steps + args.post_steps + args.long_len // min(args.chunk_sizes) + 64
    params = {"max_new_tokens": window, "ignore_eos": True}
    # Warm up outside the measurement with a prompt as long as the long one (heap growth,
    # first-call costs), so the first configuration is not measured cold.
    (warm_ids,), _ = common.random_requests(1, (args.long_len,) * 2, (1, 1), vocab, seed=3)
    engine.generate(input_ids=warm_ids, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    engine.flush_cache()
    # stream=True: a streaming request reports every token as it is produced
    rids = [engine.add_request(input_ids=ids, sampling_params=params, stream=True) for ids in decode_ids]
    while any(len(engine.rid_to_state[r].output_ids) < 2 for r in rids):  # all prefilled and decoding
        engine.step()
    last_len = {r: len(engine.rid_to_state[r].output_ids) for r in rids}
    last_t = dict.fromkeys(rids, time.perf_counter())
    gaps: List[float] = []

    def step_and_record() -> float:
        engine.step()
        now = time.perf_counter()
        for r in rids:
            n = len(engine.rid_to_state[r].output_ids)
            if n > last_len[r]:
                gaps.append((now - last_t[r]) / (n - last_len[r]))
                last_len[r], last_t[r] = n, now
        return now

    for _ in range(args.pre_steps):
        step_and_record()
    t_arrive = time.perf_counter()
    long_rid = engine.add_request(input_ids=long_ids, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    long_steps = 0
    while not engine.rid_to_state[long_rid].finished:
        now = step_and_record()
        long_steps += 1
    ttft = now - t_arrive
    for _ in range(args.post_steps):
        step_and_record()
    engine.shutdown()
    return {"gaps": gaps, "long_ttft": ttft, "long_steps": long_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_runtime_args(p)
    p.add_argument("--num-decode", type=int, default=16, help="Requests decoding when the long prompt arrives.")
    p.add_argument("--decode-input-len", type=int, default=32)
    p.add_argument("--long-len", type=int, default=4000, help="Tokens of the prompt that arrives mid-decode.")
    p.add_argument("--pre-steps", type=int, default=8)
    p.add_argument("--post-steps", type=int, default=8)
    p.add_argument("--chunk-sizes", type=int, nargs=2, default=(256, 1024), metavar=("SMALL", "LARGE"))
    args = p.parse_args()
    common.apply_runtime_args(args)
    model_path, shape = common.model_from_args(args, flops_floor=False)
    small, large = args.chunk_sizes
    configs = [("off", -1, False), (f"chunk{small}", small, False), (f"chunk{large}", large, False),
               (f"mixed{small}", small, True), (f"mixed{large}", large, True)]  # fmt: skip
    common.print_header(
        "decode inter-token latency while a long prompt prefills",
        {"num_decode": args.num_decode, "decode_input_len": args.decode_input_len, "long_len": args.long_len,
         "pre_steps": args.pre_steps, "post_steps": args.post_steps},
        {"model": model_path, "params": common.params_label(model_path, shape), "device": args.device, "dtype": args.dtype,
         "configs": [{"name": n, "chunked_prefill_size": c, "enable_mixed_chunk": m} for n, c, m in configs]},
    )  # fmt: skip
    p99: Dict[str, float] = {}
    for name, chunk, mixed in configs:
        res = measure(model_path, chunk, mixed, args, shape.vocab)
        lat = common.print_latency(f"{name}_itl", res["gaps"])
        p99[name] = lat["p99"]
        common.print_result(f"{name}_long_ttft", res["long_ttft"] * 1e3, "ms", f"{res['long_steps']} steps to prefill the long prompt")
    for name in p99:
        if name != "off":
            note = "target <= 0.25" if name == f"mixed{small}" else ""
            common.print_result(f"{name}_itl_p99_vs_off", common.ratio(p99[name], p99["off"]), "x", note)


if __name__ == "__main__":
    main()
