"""Every Triton kernel in kernels/ against its torch reference (issue 6).

On CPU the kernels run through the Triton interpreter (TRITON_INTERPRET=1, set
before any kernel module is imported), so shapes stay small; with a CUDA GPU the
same tests run on the device. KV slots come from the real allocators with
requests allocated in interleaved chunks, so each request's slots are
non-contiguous and (page_size 16) its pages are scattered.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from kernel_helpers import kv_buffers, paged_req_to_token  # noqa: E402

from minisgl.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from minisgl.kernels.extend_attention import extend_attention, extend_attention_ref  # noqa: E402
from minisgl.kernels.fused_add_rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref  # noqa: E402
from minisgl.kernels.rotary_embedding import rotary_embedding_inplace, rotary_embedding_ref  # noqa: E402
from minisgl.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 (off: a GPU is present)")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="no CUDA GPU")),
]
LENS = [1, 7, 33, 129]  # irregular: one token, under a page, just over two pages, just over eight


def tol(dtype: torch.dtype) -> dict:
    # bf16 outputs: the kernel truncates fp32 -> bf16 on store in the interpreter (1 ulp)
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_leaves_padding(device: str, page_size: int, dtype: torch.dtype) -> None:
    r2t, rows, S = paged_req_to_token([7, 33], page_size, device)
    loc = torch.cat([r2t[rows[0], :7], r2t[rows[1], :33]])  # [40] non-contiguous slots
    k_buf = torch.full((S, 2, 64), 7.0, dtype=dtype, device=device)
    v_buf = torch.full((S, 2, 64), -7.0, dtype=dtype, device=device)
    qkv = torch.randn(40, 4, 64, device=device)  # k and v as strided views of one tensor
    k, v = qkv[:, :2], qkv[:, 2:]
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv_ref(k_ref, v_ref, loc, k, v)
    store_kv(k_buf, v_buf, loc, k, v)
    torch.testing.assert_close(k_buf, k_ref, **tol(dtype))
    torch.testing.assert_close(v_buf, v_ref, **tol(dtype))
    assert (k_buf[0] == 7.0).all() and (v_buf[0] == -7.0).all(), "padding slot 0 was written"
    untouched = torch.ones(S, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert (k_buf[untouched] == 7.0).all(), "a slot outside loc was written"


# ---------------------------------------------------------------- decode_attention


DECODE_CASES = [  # (page_size, gqa group, head_dim, dtype, num_kv_splits)
    (1, 1, 64, torch.float32, 4),
    (16, 2, 128, torch.float32, 3),
    (16, 4, 64, torch.float32, 1),
    (1, 4, 128, torch.float32, 8),
    (16, 2, 64, torch.bfloat16, 4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,group,head_dim,dtype,splits", DECODE_CASES)
def test_decode_attention_matches_reference(
    device: str, page_size: int, group: int, head_dim: int, dtype: torch.dtype, splits: int
) -> None:
    Hkv = 1 if group == 4 else 2
    Hq = Hkv * group
    r2t, rows, S = paged_req_to_token(LENS, page_size, device)
    k_buf, v_buf = kv_buffers(S, Hkv, head_dim, dtype, device)
    q = torch.randn(len(LENS), Hq, head_dim).to(dtype).to(device)
    seq_lens = torch.tensor(LENS, device=device)
    scale = head_dim**-0.5
    out = decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, scale, num_kv_splits=splits)
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rows, seq_lens, scale)
    torch.testing.assert_close(out, ref, **tol(dtype))


# ---------------------------------------------------------------- extend_attention


EXTEND_CASES = [  # (page_size, gqa group, head_dim, dtype)
    (1, 2, 64, torch.float32),
    (16, 1, 128, torch.float32),
    (16, 4, 64, torch.float32),
    (16, 2, 64, torch.bfloat16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,group,head_dim,dtype", EXTEND_CASES)
def test_extend_attention_matches_reference(
    device: str, page_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    # extend lens 1, 7, 33, 129 over prefixes 40, 0, 9, 17 (a decode-like row, a fresh prefill, two radix hits)
    prefix = [40, 0, 9, 17]
    Hkv = 1 if group == 4 else 2
    Hq = Hkv * group
    r2t, rows, S = paged_req_to_token([p + e for p, e in zip(prefix, LENS)], page_size, device)
    k_buf, v_buf = kv_buffers(S, Hkv, head_dim, dtype, device)
    q = torch.randn(sum(LENS), Hq, head_dim).to(dtype).to(device)
    prefix_lens = torch.tensor(prefix, device=device)
    extend_lens = torch.tensor(LENS, device=device)
    scale = head_dim**-0.5
    out = extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, scale, max_extend_len=max(LENS))
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, scale)
    torch.testing.assert_close(out, ref, **tol(dtype))


# ---------------------------------------------------------------- fused_add_rmsnorm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rmsnorm_matches_reference(device: str, dtype: torch.dtype, with_residual: bool) -> None:
    H = 96  # not a power of two: the kernel's masked lanes must not count in the mean
    x = torch.randn(33, H).to(dtype).to(device)
    residual = torch.randn(33, H).to(dtype).to(device) if with_residual else None
    weight = (1 + 0.1 * torch.randn(H)).to(dtype).to(device)
    out, res_out = fused_add_rmsnorm(x, residual, weight, 1e-6)
    out_ref, res_ref = fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(res_out, res_ref, **tol(dtype))
    torch.testing.assert_close(out, out_ref, **tol(dtype))


# ---------------------------------------------------------------- rotary_embedding


def cos_sin_cache(max_pos: int, D: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2).float() / D)  # [D/2]
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,group,is_neox,dtype", [
    (64, 1, True, torch.float32), (128, 4, True, torch.float32), (64, 2, False, torch.float32),
    (128, 2, True, torch.bfloat16),
])  # fmt: skip
def test_rotary_embedding_matches_reference(
    device: str, head_dim: int, group: int, is_neox: bool, dtype: torch.dtype
) -> None:
    N, Hkv = 7, 2
    qkv = torch.randn(N, Hkv * group + Hkv, head_dim).to(dtype).to(device)
    q, k = qkv[:, : Hkv * group], qkv[:, Hkv * group :]  # strided views, as after a fused qkv projection
    positions = torch.tensor([0, 1, 2, 40, 41, 300, 511], device=device)
    cache = cos_sin_cache(512, head_dim).to(device)
    q_ref, k_ref = rotary_embedding_ref(q, k, positions, cache, is_neox)
    rotary_embedding_inplace(q, k, positions, cache, is_neox)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))
    assert not torch.allclose(q[5].float(), qkv.new_zeros(1).float()), "rotation zeroed the data"


def test_rotary_layouts_differ() -> None:
    """neox and GPT-J layouts are different rotations: a test of one must not pass the other."""
    q = torch.randn(3, 2, 64)
    pos = torch.tensor([1, 5, 9])
    cache = cos_sin_cache(16, 64)
    a, _ = rotary_embedding_ref(q, q[:, :1], pos, cache, True)
    b, _ = rotary_embedding_ref(q, q[:, :1], pos, cache, False)
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------- wrapper checks


def test_wrappers_reject_bad_arguments() -> None:
    k_buf = torch.zeros(32, 2, 64)
    r2t = torch.zeros(2, 16, dtype=torch.int64)
    idx = torch.tensor([0, 1])
    lens = torch.tensor([3, 4])
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="k has shape"):
        store_kv(k_buf, k_buf.clone(), torch.tensor([1, 2]), torch.zeros(2, 3, 64), torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="loc has dtype"):
        store_kv(k_buf, k_buf.clone(), torch.tensor([1.0]), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="not a multiple of the 2 KV heads"):
        decode_attention(torch.randn(2, 3, 64), k_buf, k_buf, r2t, idx, lens, 0.1)
    with pytest.raises(ValueError, match="v_buffer has dtype"):
        decode_attention(q, k_buf, k_buf.bfloat16(), r2t, idx, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens has shape"):
        decode_attention(q, k_buf, k_buf, r2t, idx, torch.tensor([3]), 0.1)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        extend_attention(q[0], k_buf, k_buf, r2t, idx, lens, lens, 0.1)
    with pytest.raises(ValueError, match="stride 1 on its last dim"):
        decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k_buf, k_buf, r2t, idx, lens, 0.1)
    with pytest.raises(ValueError, match="weight has shape"):
        fused_add_rmsnorm(torch.randn(3, 64), None, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="only full rotary"):
        rotary_embedding_inplace(q, q[:, :2], torch.tensor([0, 1]), cos_sin_cache(8, 32))


def test_extend_attention_prefetches_only_what_shared_memory_holds() -> None:
    """Triton's default 3 stages of 64x128 bf16 K/V tiles need 112 KB of shared memory (a consumer
    GPU has 99), 64x256 bf16 or 64x128 float32 224 KB (an A100 has 163): "out of resources" at
    the first prefill. (Found by reading; the CUDA run is issue 6's.)"""
    from minisgl.kernels.extend_attention import SMEM_HEADROOM_BYTES, pipeline_stages

    kb = 1024
    assert pipeline_stages(64, 64, 128, 2, 227 * kb) == 3  # H100, bf16, head 128: the default
    assert pipeline_stages(64, 64, 128, 2, 99 * kb) == 2  # a consumer GPU
    assert pipeline_stages(64, 64, 256, 2, 163 * kb) == 1  # A100, head 256
    for d in (64, 128, 256):
        for elem in (2, 4):
            for smem in (99 * kb, 163 * kb, 227 * kb):
                stages = pipeline_stages(64, 64, d, elem, smem)
                used = 64 * d * elem + stages * 2 * 64 * d * elem
                assert stages == 1 or used <= smem - SMEM_HEADROOM_BYTES
