"""TritonAttnBackend: paged attention through the Triton kernels in kernels/ (the CUDA path).

Where it sits: RadixAttention -> `forward_batch.attn_backend.forward(q, k, v, layer_id, ...)`.
In: q [N, Hq, D], k/v [N, Hkv, D] of this pass; out: [N, Hq, D] in q's dtype.
Owns only the per-batch metadata built in `init_forward_metadata`.

Per layer:
1. `store_kv` writes the new K/V at `forward_batch.out_cache_loc` in the layer's buffers;
2. decode: `decode_attention` (flash-decoding, `num_kv_splits` chunks per request);
   extend and MIXED: `extend_attention` (a decoding request in a MIXED batch is an
   extend of length 1). Both read every K/V row through req_to_token, so any page_size
   works and nothing is gathered into a padded copy as the torch backend does.

The grid of extend_attention needs the longest extend; it comes from the host-side
`extend_seq_lens_cpu`, so no device sync happens inside a forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from minisgl.kernels.common import check_head_dim
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.extend_attention import extend_attention
from minisgl.kernels.store_kv import store_kv
from minisgl.layers.attention.base import AttentionBackend
from minisgl.model_executor.forward_batch_info import ForwardBatch


# Splits of the KV length in decode. On a GPU, more splits fill the SMs when the batch
# is small; under the CPU interpreter every program costs ~25 ms, so use one.
GPU_NUM_KV_SPLITS = 8


@dataclass
class TritonAttnMetadata:
    # the batch these were built for (checked in forward). A weak reference: the batch holds
    # this backend, and a strong one made a cycle that kept the KV pool alive after
    # Engine.shutdown() until the cycle collector ran (a second Engine on a GPU saw no memory)
    forward_batch: "weakref.ReferenceType[ForwardBatch]"
    max_extend_len: int  # longest extend in the batch: sizes the extend grid (0 for decode)
    extend_start_loc: Optional[torch.Tensor]  # [bs] first row of each request in q (extend only)


class TritonAttnBackend(AttentionBackend):
    def __init__(self, device: str, head_dim: int) -> None:
        try:
            check_head_dim(head_dim)  # at start-up, not at the first request
        except ValueError as e:
            raise ValueError(f"{e}; use --attention-backend torch for this model") from None
        on_gpu = str(device).startswith("cuda")
        self.num_kv_splits = GPU_NUM_KV_SPLITS if on_gpu else 1
        self.metadata: Optional[TritonAttnMetadata] = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            self.metadata = TritonAttnMetadata(weakref.ref(forward_batch), 0, None)
            return
        assert forward_batch.extend_seq_lens is not None and forward_batch.extend_seq_lens_cpu is not None
        extend_lens = forward_batch.extend_seq_lens  # [bs]
        start_loc = torch.cumsum(extend_lens, dim=0) - extend_lens  # [bs] exclusive prefix sum
        self.metadata = TritonAttnMetadata(weakref.ref(forward_batch), max(forward_batch.extend_seq_lens_cpu, default=0), start_loc)

    def forward(
        self,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:  # [N, Hq, D]
        if self.metadata is None or self.metadata.forward_batch() is not forward_batch:
            self.init_forward_metadata(forward_batch)  # called directly, without the ModelRunner
        md = self.metadata
        assert md is not None
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)  # [S, Hkv, D] each
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        req_to_token = forward_batch.req_to_token_pool.req_to_token  # [R, max_context_len]
        if forward_batch.forward_mode.is_decode():
            return decode_attention(
                q, k_buf, v_buf, req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                scaling, num_kv_splits=self.num_kv_splits,
            )  # fmt: skip
        assert forward_batch.extend_prefix_lens is not None and forward_batch.extend_seq_lens is not None
        return extend_attention(
            q, k_buf, v_buf, req_to_token, forward_batch.req_pool_indices,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, scaling,
            max_extend_len=md.max_extend_len, extend_start_loc=md.extend_start_loc,
        )  # fmt: skip
