"""CpuAttnBackend: the CPU path's attention; decode reads the paged pool in place through a C kernel.

Where it sits: RadixAttention -> `forward_batch.attn_backend.forward(q, k, v, layer_id, ...)`,
chosen by `--attention-backend cpu` (the default on CPU in float32 when a C compiler is
present; `torch` otherwise). In: q [N, Hq, D], k/v [N, Hkv, D] of this pass; out [N, Hq, D].

- decode: store the new K/V at `out_cache_loc`, then `decode_attention_cpu`
  (kernels/decode_attention_cpu.py) reads each request's K/V rows where they lie in the
  pool, through req_to_token, once. No gather copy, no padding, no per-group metadata.
- extend, MIXED and TARGET_VERIFY, per request:
  - one new token (the decode rows riding in a MIXED batch, or a 1-token prompt): decode
    attention too -- one query over all of its keys -- through the same kernel;
  - a few new tokens over a prefix (at most SHORT_EXTEND_ROWS: a verify pass's last token and
    drafts, the tail of a prompt the radix cache mostly held): each row is a decode query of its
    own, over the keys up to its position (causal by seq_len), through the same kernel. The
    group path gathered the whole prefix's K/V through the pool for them, in every layer: a verify
    pass with drafts cost 3x a decode step of the same batch;
  - a fresh prompt (no cached prefix) of at least FRESH_MIN_TOKENS tokens: its keys are
    exactly this pass's k/v rows, so SDPA runs on them with `is_causal=True`: no gather
    through the pool, no padding, no mask tensor (1.3x faster than a padded, masked group
    on the benchmark's prompts);
  - the rest (a cached prefix, or short prompts that are cheaper batched): the torch
    backend's path, gather + SDPA per length group.
  A prefill is dominated by its matmuls; SDPA's CPU flash kernel beat a matmul-based
  attention by 30-40% on this machine, so no C kernel for it.
The same backend choice routes RMSNorm, RoPE and SiLU through the C kernels
fused_add_rmsnorm_cpu, rotary_embedding_cpu and silu_and_mul_cpu (ModelRunner passes
kernels="cpu" to the model).

Why a separate backend rather than branches in the torch one: the torch backend stays the
plain-torch reference that every kernel is checked against; this one only changes which
path each request's rows take, and falls back to the reference's for the rest.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from minisgl.kernels.cpu_build import load_all_cpu_kernels
from minisgl.kernels.decode_attention_cpu import decode_attention_cpu
from minisgl.layers.attention.torch_backend import SDPA_HAS_GQA, TorchNativeAttnBackend, first_rows
from minisgl.model_executor.forward_batch_info import ForwardBatch


# Below this, per-request SDPA calls cost more in dispatch than padding costs in a group.
FRESH_MIN_TOKENS = 32
# Up to this many new tokens over a prefix, each row runs as a decode query (no gather of the prefix).
SHORT_EXTEND_ROWS = 16


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self) -> None:
        super().__init__()
        # Build (or load the cached build of) the kernels now: a missing compiler fails at
        # startup with its message, not in the middle of the first decode step.
        load_all_cpu_kernels()
        # extend batches: (q rows, req_pool_indices, seq_lens) of the rows that run as decode
        # queries (one-token requests, short extends over a prefix), or None
        self.single_token: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        # extend batches: (first row, length) in q/k/v of each fresh prompt
        self.fresh: List[Tuple[int, int]] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        self.single_token, self.fresh = None, []
        if fb.forward_mode.is_decode():
            self.groups = None  # the kernel reads req_to_token directly: nothing to precompute
            return
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        q_lens, prefix_lens = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        q_starts = first_rows(q_lens)
        single, fresh, grouped = [], [], []
        for i, (n, prefix) in enumerate(zip(q_lens, prefix_lens)):
            if n == 1 or (prefix > 0 and n <= SHORT_EXTEND_ROWS):
                single.append(i)
            elif prefix == 0 and n >= FRESH_MIN_TOKENS and SDPA_HAS_GQA:  # (views need SDPA's own GQA)
                fresh.append(i)
            else:
                grouped.append(i)
        self.groups = self.make_groups(fb, grouped)
        self.fresh = [(q_starts[i], q_lens[i]) for i in fresh]
        if single:
            # row j of request i attends to positions [0, prefix + j]: seq_len prefix + j + 1
            rows = [(q_starts[i] + j, i, prefix_lens[i] + j + 1) for i in single for j in range(q_lens[i])]
            picked = torch.tensor([i for _, i, _ in rows], dtype=torch.int64)
            self.single_token = (
                torch.tensor([row for row, _, _ in rows], dtype=torch.int64),  # their rows in q
                fb.req_pool_indices[picked],
                torch.tensor([seq_len for _, _, seq_len in rows], dtype=torch.int64),
            )

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
        pool = fb.token_to_kv_pool
        r2t = fb.req_to_token_pool.req_to_token
        if not fb.forward_mode.is_decode():
            out = super().forward(q, k, v, layer_id, scaling, fb)  # stores K/V, fills the grouped rows
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            for start, n in self.fresh:
                rows = slice(start, start + n)
                # [n, H, D] -> [1, H, n, D]: SDPA's CPU flash kernel wants 4-D inputs; given 3-D
                # ones it falls back to the math path (bmm + softmax + mask), 1.5x slower.
                qh, kh, vh = (x[rows].transpose(0, 1)[None] for x in (q, k, v))
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scaling, **gqa)  # [1, Hq, n, D]
                out[rows] = o[0].transpose(0, 1)
            if self.single_token is not None:
                rows, req_pool_indices, seq_lens = self.single_token
                k_buf, v_buf = pool.get_kv_buffer(layer_id)
                out[rows] = decode_attention_cpu(q[rows], k_buf, v_buf, r2t, req_pool_indices, seq_lens, scaling)
            return out
        pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)  # [pool_size + page_size, Hkv, D] each
        return decode_attention_cpu(q, k_buf, v_buf, r2t, fb.req_pool_indices, fb.seq_lens, scaling)  # [B, Hq, D]
