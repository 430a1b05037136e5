"""TorchNativeAttnBackend: paged attention in plain torch (the CPU path, and the reference).

Where it sits: RadixAttention -> `forward_batch.attn_backend.forward(q, k, v, layer_id, ...)`.
In: q [N, Hq, D], k/v [N, Hkv, D] of this pass; out: [N, Hq, D].
Owns nothing but the per-batch metadata built in `init_forward_metadata`.

Per layer, as in SGLang's torch_native backend:
1. store the new K/V at `out_cache_loc` (so the pool holds every token of every request);
2. gather each request's K/V from the pool through `req_to_token[req_pool_idx, :seq_len]`;
3. one batched `scaled_dot_product_attention` over the requests padded to the longest.

Extend: the extend tokens of request i sit at positions prefix_len_i + j; query j may see
key positions 0 .. prefix_len_i + j (cached prefix + the new tokens up to itself).
Decode: one query per request sees all of its seq_len keys.
The gather indices and masks depend only on the batch, so they are built once per forward
(init_forward_metadata), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from minisgl.layers.attention.base import AttentionBackend
from minisgl.model_executor.forward_batch_info import ForwardBatch


# enable_gqa lets SDPA broadcast KV heads without materialising repeat_interleave (torch >= 2.5).
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass
class TorchAttnMetadata:
    kv_indices: torch.Tensor  # [bs, max_seq_len] KV slot of each key position (0 = padding slot)
    attn_mask: torch.Tensor  # [bs, 1, max_q_len, max_seq_len] bool, True = may attend
    q_index: torch.Tensor  # [bs, max_q_len] row of input_ids for each padded query (0 for padding)
    token_index: torch.Tensor  # [num_tokens] row of the flattened [bs * max_q_len] output per token


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self.metadata: Optional[TorchAttnMetadata] = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            self.metadata = self._decode_metadata(forward_batch)
        else:
            self.metadata = self._extend_metadata(forward_batch)

    @staticmethod
    def _gather_kv_indices(forward_batch: ForwardBatch, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = forward_batch.seq_lens.device
        key_pos = torch.arange(max_seq_len, device=device)  # [max_seq_len]
        kv_valid = key_pos[None, :] < forward_batch.seq_lens[:, None]  # [bs, max_seq_len]
        rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :max_seq_len]
        # Positions past seq_len may hold stale slot ids; point them at the padding slot 0.
        kv_indices = torch.where(kv_valid, rows, torch.zeros_like(rows))  # [bs, max_seq_len]
        return kv_indices, kv_valid

    def _decode_metadata(self, forward_batch: ForwardBatch) -> TorchAttnMetadata:
        bs = forward_batch.batch_size
        device = forward_batch.seq_lens.device
        kv_indices, kv_valid = self._gather_kv_indices(forward_batch, max(forward_batch.seq_lens_cpu))
        rows = torch.arange(bs, device=device)  # [bs]
        return TorchAttnMetadata(kv_indices, kv_valid[:, None, None, :], rows[:, None], rows)

    def _extend_metadata(self, forward_batch: ForwardBatch) -> TorchAttnMetadata:
        assert forward_batch.extend_seq_lens is not None and forward_batch.extend_prefix_lens is not None
        assert forward_batch.extend_seq_lens_cpu is not None
        device = forward_batch.seq_lens.device
        bs = forward_batch.batch_size
        extend_lens = forward_batch.extend_seq_lens  # [bs]
        max_q_len = max(forward_batch.extend_seq_lens_cpu)
        kv_indices, kv_valid = self._gather_kv_indices(forward_batch, max(forward_batch.seq_lens_cpu))

        starts = torch.cumsum(extend_lens, 0) - extend_lens  # [bs] first row of each request in input_ids
        q_pos = torch.arange(max_q_len, device=device)  # [max_q_len]
        q_valid = q_pos[None, :] < extend_lens[:, None]  # [bs, max_q_len]
        q_index = torch.where(q_valid, starts[:, None] + q_pos[None, :], torch.zeros_like(q_valid, dtype=torch.int64))

        # Causal over absolute positions: query j of request i sits at prefix_len_i + j.
        q_abs = forward_batch.extend_prefix_lens[:, None] + q_pos[None, :]  # [bs, max_q_len]
        key_pos = torch.arange(kv_indices.shape[1], device=device)  # [max_seq_len]
        causal = key_pos[None, None, :] <= q_abs[:, :, None]  # [bs, max_q_len, max_seq_len]
        attn_mask = (causal & kv_valid[:, None, :])[:, None]  # [bs, 1, max_q_len, max_seq_len]

        req_of_token = torch.repeat_interleave(
            torch.arange(bs, device=device), extend_lens, output_size=forward_batch.num_tokens
        )  # [N]; output_size given: no device sync on CUDA
        local = torch.arange(forward_batch.num_tokens, device=device) - starts[req_of_token]  # [N]
        token_index = req_of_token * max_q_len + local  # [N]
        return TorchAttnMetadata(kv_indices, attn_mask, q_index, token_index)

    def forward(
        self,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        md = self.metadata
        assert md is not None, "init_forward_metadata must run before the layers"
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)  # [pool_size + page_size, Hkv, D] each

        keys = k_buf[md.kv_indices].transpose(1, 2)  # [bs, Hkv, max_seq_len, D]
        values = v_buf[md.kv_indices].transpose(1, 2)  # [bs, Hkv, max_seq_len, D]
        queries = q[md.q_index].transpose(1, 2)  # [bs, Hq, max_q_len, D]
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        if num_heads != num_kv_heads and not _SDPA_HAS_GQA:
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [bs, Hq, max_seq_len, D]
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        extra = {"enable_gqa": True} if num_heads != num_kv_heads and _SDPA_HAS_GQA else {}
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=md.attn_mask, scale=scaling, **extra
        )  # [bs, Hq, max_q_len, D]
        out = out.transpose(1, 2).reshape(-1, num_heads, q.shape[2])  # [bs * max_q_len, Hq, D]
        return out[md.token_index]  # [N, Hq, D]
