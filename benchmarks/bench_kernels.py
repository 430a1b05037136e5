"""How close does each Triton kernel come to the device's memory bandwidth, and how much
faster is it than the torch path it replaces?

For each kernel: time it and its torch baseline in the same run (the torch attention
backend for decode/extend; the *_ref functions for the rest), count the bytes the
kernel must move (its module docstring gives the formula) and report GB/s, the
speed-up over torch, and the fraction of a plain device copy's bandwidth (copy_
measured first, read + write bytes counted).

    python benchmarks/bench_kernels.py            # CUDA, bf16, realistic shapes
    python benchmarks/bench_kernels.py --smoke    # any machine (interpreter on CPU), tiny shapes

--smoke checks that the script runs; its timings mean nothing under the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Callable, Dict, List

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # the paged-batch builders live beside the kernel tests
from test_kernels import cos_sin_cache, paged_req_to_token  # noqa: E402

import common  # noqa: E402


from minisgl.kernels.fused_add_rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref  # noqa: E402
from minisgl.kernels.rotary_embedding import rotary_embedding_inplace, rotary_embedding_ref  # noqa: E402
from minisgl.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from minisgl.layers.attention.torch_backend import TorchNativeAttnBackend  # noqa: E402
from minisgl.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from minisgl.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402


def bench(fn: Callable[[], object], device: str, iters: int) -> float:
    """Median milliseconds of fn() after a warm-up (CUDA events on GPU, wall clock on CPU)."""
    fn()
    times: List[float] = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def attention_batch(lens: List[int], prefix: List[int], mode: ForwardMode, cfg: SimpleNamespace) -> tuple:
    """A one-layer pool + ForwardBatch with requests of `prefix` cached tokens and `lens` new ones."""
    dev, P = cfg.device, cfg.page_size
    seq = [p + e for p, e in zip(prefix, lens)]
    r2t, rows, S = paged_req_to_token(seq, P, dev)
    req_pool = ReqToTokenPool(r2t.shape[0], r2t.shape[1], dev)
    req_pool.req_to_token = r2t
    kv_pool = MHATokenToKVPool(S - P, P, cfg.dtype, cfg.hkv, cfg.d, 1, dev)
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
    out_loc = torch.cat([r2t[r, p:s] for r, p, s in zip(rows.tolist(), prefix, seq)])  # [N]
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(lens), input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=dev),
        positions=torch.zeros(len(out_loc), dtype=torch.int64, device=dev), out_cache_loc=out_loc,
        req_pool_indices=rows, seq_lens=t(seq), seq_lens_cpu=seq, req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool, attn_backend=None,  # type: ignore[arg-type]
    )  # fmt: skip
    if mode.is_extend():
        fb.extend_prefix_lens, fb.extend_seq_lens = t(prefix), t(lens)
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix, lens
    n = len(out_loc)
    q = torch.randn(n, cfg.hq, cfg.d, dtype=cfg.dtype, device=dev)
    k = torch.randn(n, cfg.hkv, cfg.d, dtype=cfg.dtype, device=dev)
    v = torch.randn(n, cfg.hkv, cfg.d, dtype=cfg.dtype, device=dev)
    return fb, q, k, v


def bench_backends(name: str, fb: ForwardBatch, q, k, v, nbytes: int, cfg: SimpleNamespace) -> Dict:
    """Time one layer's attention (store + attend) through both backends on the same batch."""
    runner = SimpleNamespace(device=cfg.device)
    ms = {}
    for label, backend in (("triton", TritonAttnBackend(str(runner.device), cfg.d)), ("torch", TorchNativeAttnBackend())):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        ms[label] = bench(lambda: backend.forward(q, k, v, 0, cfg.d**-0.5, fb), cfg.device, cfg.iters)
    return dict(kernel=name, triton_ms=ms["triton"], torch_ms=ms["torch"], nbytes=nbytes)


def run_all(cfg: SimpleNamespace) -> List[Dict]:
    el = torch.empty(0, dtype=cfg.dtype).element_size()
    rows: List[Dict] = []
    dev, hq, hkv, d = cfg.device, cfg.hq, cfg.hkv, cfg.d

    # decode: bs requests of ctx tokens; must read all their K and V once
    fb, q, k, v = attention_batch([1] * cfg.bs, [cfg.ctx - 1] * cfg.bs, ForwardMode.DECODE, cfg)
    nbytes = 2 * cfg.bs * cfg.ctx * hkv * d * el + 2 * cfg.bs * hq * d * el
    rows.append(bench_backends(f"decode bs={cfg.bs} ctx={cfg.ctx}", fb, q, k, v, nbytes, cfg))

    # extend: a few requests with a cached prefix and a chunk of new tokens
    fb, q, k, v = attention_batch([cfg.ext] * 4, [cfg.ext] * 4, ForwardMode.EXTEND, cfg)
    nbytes = 4 * (2 * cfg.ext * hq * d + 2 * 2 * cfg.ext * hkv * d) * el
    rows.append(bench_backends(f"extend 4x(prefix {cfg.ext} + {cfg.ext})", fb, q, k, v, nbytes, cfg))

    # store_kv: N tokens into a pool at scattered slots
    n = cfg.tokens
    kb = torch.zeros(4 * n, hkv, d, dtype=cfg.dtype, device=dev)
    vb = torch.zeros_like(kb)
    loc = torch.randperm(4 * n - 1, device=dev)[:n] + 1
    kk, vv = torch.randn(n, hkv, d, dtype=cfg.dtype, device=dev), torch.randn(n, hkv, d, dtype=cfg.dtype, device=dev)
    rows.append(dict(
        kernel=f"store_kv N={n}", nbytes=4 * n * hkv * d * el,
        triton_ms=bench(lambda: store_kv(kb, vb, loc, kk, vv), dev, cfg.iters),
        torch_ms=bench(lambda: store_kv_ref(kb, vb, loc, kk, vv), dev, cfg.iters),
    ))  # fmt: skip

    # fused_add_rmsnorm: read x, residual; write out, residual_out
    x = torch.randn(n, cfg.hidden, dtype=cfg.dtype, device=dev)
    res, w = torch.randn_like(x), torch.ones(cfg.hidden, dtype=cfg.dtype, device=dev)
    rows.append(dict(
        kernel=f"fused_add_rmsnorm N={n} H={cfg.hidden}", nbytes=4 * n * cfg.hidden * el,
        triton_ms=bench(lambda: fused_add_rmsnorm(x, res, w, 1e-6), dev, cfg.iters),
        torch_ms=bench(lambda: fused_add_rmsnorm_ref(x, res, w, 1e-6), dev, cfg.iters),
    ))  # fmt: skip

    # rotary: read and write q and k once, one cache row per token
    qq, kk = torch.randn(n, hq, d, dtype=cfg.dtype, device=dev), torch.randn(n, hkv, d, dtype=cfg.dtype, device=dev)
    pos = torch.randint(0, 4096, (n,), device=dev)
    cache = cos_sin_cache(4096, d).to(dev)
    rows.append(dict(
        kernel=f"rotary N={n} Hq={hq} Hkv={hkv}", nbytes=(2 * n * (hq + hkv) * d) * el + n * d * 4,
        triton_ms=bench(lambda: rotary_embedding_inplace(qq, kk, pos, cache), dev, cfg.iters),
        torch_ms=bench(lambda: rotary_embedding_ref(qq, kk, pos, cache), dev, cfg.iters),
    ))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs under the CPU interpreter")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("bench_kernels.py needs a CUDA GPU (use --smoke to check the script under the interpreter)")
    if args.smoke:
        cfg = SimpleNamespace(bs=2, ctx=40, ext=20, tokens=8, hidden=64, hq=4, hkv=2, d=32, dtype=torch.float32, iters=1)
    else:
        cfg = SimpleNamespace(bs=64, ctx=2048, ext=512, tokens=8192, hidden=4096, hq=32, hkv=8, d=128,
                              dtype=torch.bfloat16, iters=20)  # fmt: skip
    cfg.device, cfg.page_size = device, args.page_size
    common.print_header(
        "Triton kernels vs torch, and vs the device's copy bandwidth",
        {"smoke": args.smoke, "bs": cfg.bs, "ctx": cfg.ctx, "extend": cfg.ext, "tokens": cfg.tokens},
        {"device": f"{device} ({torch.cuda.get_device_name() if device == 'cuda' else 'interpreter'})",
         "dtype": str(cfg.dtype), "page_size": cfg.page_size, "hq": cfg.hq, "hkv": cfg.hkv, "head_dim": cfg.d},
    )  # fmt: skip
    copy_gbs = common.copy_bandwidth(device, (1 << 20) if args.smoke else (1 << 30)) / 1e9
    common.print_result("device_copy_gbs", copy_gbs, "GB/s", "read + write")
    rows = run_all(cfg)
    print(f"\n{'kernel':<40} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        gbs = r["nbytes"] / r["triton_ms"] / 1e6
        print(f"{r['kernel']:<40} {r['triton_ms']:>10.3f} {r['torch_ms']:>10.3f} "
              f"{r['torch_ms'] / r['triton_ms']:>7.2f}x {gbs:>8.0f} {100 * gbs / copy_gbs:>6.0f}%")  # fmt: skip
    for r in rows:
        key = r["kernel"].split()[0]
        common.print_result(f"{key}_gbs", r["nbytes"] / r["triton_ms"] / 1e6, "GB/s", r["kernel"])
        common.print_result(f"{key}_vs_torch", r["torch_ms"] / r["triton_ms"], "x", "speed-up over the torch path")

if __name__ == "__main__":
    main()
