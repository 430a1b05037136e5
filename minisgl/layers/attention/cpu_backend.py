"""CpuAttnBackend: the CPU path's attention; decode reads the paged pool in place through a C kernel.

Where it sits: RadixAttention -> `forward_batch.attn_backend.forward(q, k, v, layer_id, ...)`,
chosen by `--attention-backend cpu` (the default on CPU in float32 when a C compiler is
present; `torch` otherwise). In: q [N, Hq, D], k/v [N, Hkv, D] of this pass; out [N, Hq, D].

- decode: store the new K/V at `out_cache_loc`, then `decode_attention_cpu`
  (kernels/decode_attention_cpu.py) reads each request's K/V rows where they lie in the
  pool, through req_to_token, once. No gather copy, no padding, no per-group metadata.
- extend and MIXED: the torch backend's path (gather + SDPA per length group). A prefill
  step is dominated by its matmuls, and SDPA's flash kernel handles the causal block well.
The same backend choice routes RMSNorm and RoPE through the C kernels fused_add_rmsnorm_cpu
and rotary_embedding_cpu (ModelRunner passes kernels="cpu" to the model).

Why a separate backend rather than a branch in the torch one: the torch backend stays the
plain-torch reference that every kernel is checked against, and this one differs from it
in exactly one method.
"""

from __future__ import annotations

import torch

from minisgl.kernels.decode_attention_cpu import decode_attention_cpu
from minisgl.kernels.cpu_build import load_all_cpu_kernels
from minisgl.layers.attention.torch_backend import TorchNativeAttnBackend
from minisgl.model_executor.forward_batch_info import ForwardBatch


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self) -> None:
        super().__init__()
        # Build (or load the cached build of) the kernel now: a missing compiler fails at
        # startup with its message, not in the middle of the first decode step.
        load_all_cpu_kernels()

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            self.groups = None  # the kernel reads req_to_token directly: nothing to precompute
            return
        super().init_forward_metadata(forward_batch)

    def forward(
        self,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        fb = forward_batch
        if not fb.forward_mode.is_decode():
            return super().forward(q, k, v, layer_id, scaling, fb)
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)  # [pool_size + page_size, Hkv, D] each
        return decode_attention_cpu(
            q, k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, scaling
        )  # [B, Hq, D]
