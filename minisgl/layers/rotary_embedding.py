"""Rotary position embedding (RoPE), NeoX layout, with default / linear / llama3 scaling.

Where it sits: decoder layer -> attention: after the q/k projections (and Qwen3's q/k
norm), before the attention backend stores K in the pool. In: q [N, Hq, D], k [N, Hkv, D],
positions [N]; q and k are rotated in place.

The cache `cos_sin_cache [max_position, D]` holds cos in its first D/2 columns and sin in
its last D/2 (float32). NeoX layout: dimension i pairs with i + D/2, so with
x1 = x[..., :D/2], x2 = x[..., D/2:]:
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
This torch path is the reference of the Triton kernel
`minisgl.kernels.rotary_embedding.rotary_embedding_inplace(q, k, positions, cos_sin_cache, is_neox=True)`.

Frequencies follow transformers' `modeling_rope_utils` bit for bit (same float32 ops), so
the parity tests can hold 1e-4.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(head_dim: int, base: float, scaling: Optional[Dict[str, Any]]) -> torch.Tensor:
    """Inverse frequencies [D/2] float32 for the given rope type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    factor = float(scaling["factor"])
    if rope_type == "linear":
        # Positions are divided by `factor`: the same thing as dividing the frequencies.
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling)
    raise ValueError(f"Unsupported rope_type {rope_type!r}; minisgl supports {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: Dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_embedding_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [N, Hq, D] and k [N, Hkv, D] in place (NeoX layout), math in float32."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]  # [N, D]
    cos = cos_sin[:, None, :half]  # [N, 1, D/2]
    sin = cos_sin[:, None, half:]  # [N, 1, D/2]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()  # [N, H, D/2] each
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [N, H, D]
        x.copy_(rotated)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: Optional[Dict[str, Any]] = None,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.kernels = kernels  # "torch" (the reference above), "triton" or "cpu" (minisgl.kernels)
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # [D/2]
        t = torch.arange(max_position, dtype=torch.int64).float()  # [max_position]
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        # float32 whatever the model dtype: cos/sin of large angles need the mantissa.
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)  # [max_position, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """positions [N] int64; q [N, Hq, D] and k [N, Hkv, D] contiguous, rotated in place."""
        if self.kernels == "triton":
            from minisgl.kernels.rotary_embedding import rotary_embedding_inplace

            rotary_embedding_inplace(q, k, positions, self.cos_sin_cache, is_neox=True)
            return
        if self.kernels == "cpu":
            from minisgl.kernels.rotary_embedding_cpu import rotary_embedding_cpu

            rotary_embedding_cpu(q, k, positions, self.cos_sin_cache)
            return
        rotary_embedding_reference(q, k, positions, self.cos_sin_cache)
