"""TorchNativeAttnBackend: paged attention in plain torch (the reference; the CPU path without the C kernels).

Where it sits: RadixAttention -> `forward_batch.attn_backend.forward(q, k, v, layer_id, ...)`.
In: q [N, Hq, D], k/v [N, Hkv, D] of this pass; out: [N, Hq, D].
Owns the per-batch groups built in `init_forward_metadata` and a reused gather workspace.

Per layer, as in SGLang's torch_native backend:
1. store the new K/V at `out_cache_loc` (so the pool holds every token of every request);
2. gather each request's K/V from the pool through `req_to_token[req_pool_idx, :seq_len]`;
3. `scaled_dot_product_attention` over the requests padded to the longest -- per group of
   requests of similar length (`group_by_length`), so padding stays small.

Extend: the extend tokens of request i sit at positions prefix_len_i + j; query j may see
key positions 0 .. prefix_len_i + j (cached prefix + the new tokens up to itself).
Decode: one query per request sees all of its seq_len keys.
The gather indices and masks depend only on the batch, so they are built once per forward
(init_forward_metadata), not once per layer.

Why the gathered K/V go into reused workspace buffers: a decode batch of 64 requests with a
few hundred tokens each gathers ~50 MB per layer. A fresh tensor that size comes from mmap
and is page-faulted in on every layer, which made the gather ~3x slower than the copy itself
(measured on this project's 2-core CPU: 25 ms -> 8 ms per layer). The workspace grows to the
largest batch seen and is reused by every layer of every forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from minisgl.layers.attention.base import AttentionBackend
from minisgl.model_executor.forward_batch_info import ForwardBatch


# enable_gqa lets SDPA broadcast KV heads without materialising repeat_interleave (torch >= 2.5).
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# A group may pad its key rows up to this factor of the real ones (plus a little slack for
# short requests) before a new group starts; each group is one gather + one SDPA call.
_GROUP_PADDING = 1.25
_GROUP_SLACK_ROWS = 64


@dataclass
class AttnGroup:
    """Requests of similar length, attended together in one padded SDPA call."""

    kv_indices: torch.Tensor  # [n * max_seq_len] KV slot of each padded key position (0 = padding slot)
    num_reqs: int
    max_seq_len: int
    attn_mask: torch.Tensor  # [n, 1, max_q_len, max_seq_len] bool, True = may attend
    q_index: torch.Tensor  # [n, max_q_len] row of q for each padded query (0 for padding)
    token_index: torch.Tensor  # [num_group_tokens] row of the flattened [n * max_q_len] output per real token
    out_rows: torch.Tensor  # [num_group_tokens] row of the layer output each real token fills


def first_rows(q_lens: List[int]) -> List[int]:
    """The first row of each request in the flattened q (an exclusive prefix sum of q_lens)."""
    starts = [0] * len(q_lens)
    for i in range(1, len(q_lens)):
        starts[i] = starts[i - 1] + q_lens[i - 1]
    return starts


def group_by_length(seq_lens: List[int]) -> List[List[int]]:
    """Requests sorted by length, cut into groups whose padding stays near the real size.

    One padded batch of every request wastes work on the short ones (a decode batch with
    lengths 100..700 gathers 1.8x its real K/V); one call per request pays Python overhead
    per request. Sorting and cutting when padding would exceed _GROUP_PADDING gets both:
    measured 21.6 -> 8.7 ms per layer for 64 decoding requests on this project's CPU.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
    groups: List[List[int]] = []
    real = 0
    for i in order:
        n = seq_lens[i]  # the longest so far: ascending order
        if groups and (len(groups[-1]) + 1) * n <= _GROUP_PADDING * (real + n) + _GROUP_SLACK_ROWS:
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self.groups: Optional[List[AttnGroup]] = None
        # [rows, Hkv, D] gather targets for K and V, reused across groups, layers and forwards
        self._k_work: Optional[torch.Tensor] = None
        self._v_work: Optional[torch.Tensor] = None

    def _workspace(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather targets of `rows` rows shaped like the pool's rows."""
        if self._k_work is None or self._k_work.shape[0] < rows or self._k_work.shape[1:] != buf.shape[1:] \
                or self._k_work.dtype != buf.dtype or self._k_work.device != buf.device:  # fmt: skip
            self._k_work = torch.empty((rows, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
            self._v_work = torch.empty_like(self._k_work)
        assert self._v_work is not None
        return self._k_work[:rows], self._v_work[:rows]

    # ------------------------------------------------------------------ metadata (once per forward)
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.groups = self.make_groups(forward_batch)

    def make_groups(self, forward_batch: ForwardBatch, requests: Optional[List[int]] = None) -> List[AttnGroup]:
        """Length groups over `requests` (indices into the batch; default: all of them)."""
        fb = forward_batch
        seq_lens = fb.seq_lens_cpu
        if fb.forward_mode.is_decode():
            q_lens, prefix_lens = [1] * fb.batch_size, [s - 1 for s in seq_lens]
        else:
            assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
            q_lens, prefix_lens = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        q_starts = first_rows(q_lens)
        chosen = list(range(fb.batch_size)) if requests is None else requests
        return [
            self._build_group(fb, [chosen[j] for j in members], q_lens, prefix_lens, q_starts)
            for members in group_by_length([seq_lens[i] for i in chosen])
        ]

    @staticmethod
    def _build_group(
        fb: ForwardBatch, members: List[int], q_lens: List[int], prefix_lens: List[int], q_starts: List[int]
    ) -> AttnGroup:
        device = fb.input_ids.device
        n = len(members)
        max_seq_len = max(fb.seq_lens_cpu[i] for i in members)
        max_q_len = max(q_lens[i] for i in members)
        # every tensor below is built from host lists: no device sync on CUDA
        m = torch.tensor(members, dtype=torch.int64, device=device)  # [n]
        seq = torch.tensor([fb.seq_lens_cpu[i] for i in members], device=device)  # [n]
        qlen = torch.tensor([q_lens[i] for i in members], device=device)  # [n]
        prefix = torch.tensor([prefix_lens[i] for i in members], device=device)  # [n]
        qstart = torch.tensor([q_starts[i] for i in members], device=device)  # [n]

        key_pos = torch.arange(max_seq_len, device=device)  # [max_seq_len]
        kv_valid = key_pos[None, :] < seq[:, None]  # [n, max_seq_len]
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[m], :max_seq_len]  # [n, max_seq_len]
        # Positions past seq_len may hold stale slot ids; point them at the padding slot 0.
        kv_indices = torch.where(kv_valid, rows, torch.zeros_like(rows)).reshape(-1)  # [n * max_seq_len]

        q_pos = torch.arange(max_q_len, device=device)  # [max_q_len]
        q_valid = q_pos[None, :] < qlen[:, None]  # [n, max_q_len]
        q_index = torch.where(q_valid, qstart[:, None] + q_pos[None, :], torch.zeros_like(q_pos)[None, :])
        # Causal over absolute positions: query j of a request sits at prefix_len + j.
        q_abs = prefix[:, None] + q_pos[None, :]  # [n, max_q_len]
        causal = key_pos[None, None, :] <= q_abs[:, :, None]  # [n, max_q_len, max_seq_len]
        attn_mask = (causal & kv_valid[:, None, :])[:, None]  # [n, 1, max_q_len, max_seq_len]

        local = q_pos[None, :].expand(n, max_q_len)[q_valid]  # [num_group_tokens] query j of its request
        owner = torch.arange(n, device=device)[:, None].expand(n, max_q_len)[q_valid]  # [num_group_tokens]
        token_index = owner * max_q_len + local  # [num_group_tokens]
        out_rows = q_index[q_valid]  # [num_group_tokens]
        return AttnGroup(kv_indices, n, max_seq_len, attn_mask, q_index, token_index, out_rows)

    # ------------------------------------------------------------------ per layer
    def forward(
        self,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        assert self.groups is not None, "init_forward_metadata must run before the layers"
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer_id)  # [pool_size + page_size, Hkv, D] each
        num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        gqa = num_heads != num_kv_heads
        out = q.new_empty(q.shape)  # [N, Hq, D]
        for g in self.groups:
            k_work, v_work = self._workspace(k_buf, g.kv_indices.numel())
            torch.index_select(k_buf, 0, g.kv_indices, out=k_work)  # [n * max_seq_len, Hkv, D]
            torch.index_select(v_buf, 0, g.kv_indices, out=v_work)
            if k_work.dtype != q.dtype:  # a bfloat16 pool under a float32 model (--kv-cache-dtype)
                k_work, v_work = k_work.to(q.dtype), v_work.to(q.dtype)
            keys = k_work.view(g.num_reqs, g.max_seq_len, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
            values = v_work.view(g.num_reqs, g.max_seq_len, num_kv_heads, head_dim).transpose(1, 2)
            queries = q[g.q_index].transpose(1, 2)  # [n, Hq, max_q_len, D]
            if gqa and not SDPA_HAS_GQA:
                keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, Hq, L, D]
                values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
            extra = {"enable_gqa": True} if gqa and SDPA_HAS_GQA else {}
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=g.attn_mask, scale=scaling, **extra
            )  # [n, Hq, max_q_len, D]
            o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [n * max_q_len, Hq, D]
            out.index_copy_(0, g.out_rows, o[g.token_index])
        return out
