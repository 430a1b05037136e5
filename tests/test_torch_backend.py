"""The torch attention backend's length groups: every request in exactly one group, padding
bounded, and grouped attention equal to attending each request alone."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.layers.attention import torch_backend
from minisgl.layers.attention.torch_backend import TorchNativeAttnBackend, group_by_length
from minisgl.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2000), min_size=1, max_size=80))
def test_groups_partition_the_batch_with_bounded_padding(seq_lens):
    groups = group_by_length(seq_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
    for g in groups:
        real = sum(seq_lens[i] for i in g)
        padded = len(g) * max(seq_lens[i] for i in g)
        assert padded <= torch_backend._GROUP_PADDING * real + torch_backend._GROUP_SLACK_ROWS
    assert len(groups) <= len(seq_lens)


def test_decode_over_many_groups_equals_each_request_alone():
    torch.manual_seed(0)
    rng = random.Random(0)
    bs, hq, hkv, d, size = 12, 4, 2, 16, 4096
    seq_lens = [rng.choice([3, 40, 41, 300, 900]) for _ in range(bs)]
    assert len(group_by_length(seq_lens)) > 1  # the test must exercise several groups
    pool = MHATokenToKVPool(size, 1, torch.float32, hkv, d, num_layers=1)
    req_to_token = ReqToTokenPool(bs, 1024)
    slots = torch.randperm(size)[: sum(seq_lens)] + 1  # scattered slots, never 0
    offset = 0
    for i, n in enumerate(seq_lens):
        req_to_token.write(i, 0, slots[offset : offset + n])
        offset += n
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    q = torch.randn(bs, hq, d)
    k_new, v_new = torch.randn(bs, hkv, d), torch.randn(bs, hkv, d)
    out_loc = torch.tensor([int(req_to_token.req_to_token[i, n - 1]) for i, n in enumerate(seq_lens)])
    backend = TorchNativeAttnBackend()
    fb = ForwardBatch(
        ForwardMode.DECODE, bs, torch.zeros(bs, dtype=torch.int64), torch.tensor(seq_lens) - 1, out_loc,
        torch.arange(bs), torch.tensor(seq_lens), seq_lens, req_to_token, pool, backend,
    )  # fmt: skip
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k_new, v_new, 0, d**-0.5, fb)  # [bs, hq, d]
    for i, n in enumerate(seq_lens):
        idx = req_to_token.req_to_token[i, :n]
        keys = pool.k_buffer[0][idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [hq, n, d]
        values = pool.v_buffer[0][idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, values, scale=d**-0.5)[:, 0]  # [hq, d]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)
