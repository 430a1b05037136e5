"""Memory pools: request rows and the paged K/V buffers (sglang-facts.md §4.1, §4.4).

Where it sits: two levels of indirection, as in SGLang.
- ReqToTokenPool: one row per running request; `req_to_token[row, pos]` is the KV slot
  that holds the K/V of token `pos` of that request.
- MHATokenToKVPool: per layer, `k_buffer[layer][slot]` and `v_buffer[layer][slot]`,
  each `[size + page_size, num_kv_heads, head_dim]`; slot 0 is the padding slot. Under
  --tp-size N, num_kv_heads is this rank's (ModelConfig.get_num_kv_heads(N)): each rank's
  pool holds the K/V of its own heads, at the same slots as every other rank's.
The allocator (allocator.py) decides which slots are free; the attention backend reads
K/V through `req_to_token[req_pool_indices, :seq_len]` and writes new K/V at
`out_cache_loc`.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        # [size, max_context_len] int64 KV slot per (request row, position)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots: List[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[List[int]]:
        """`need_size` request rows, or None when the pool is full."""
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, row: int) -> None:
        assert 0 <= row < self.size and row not in self.free_slots, f"double free of request row {row}"
        self.free_slots.append(row)

    def write(self, row: int, start: int, values: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(values)] = values

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """K and V buffers, one tensor per layer, indexed by KV slot."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str = "cpu",
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.device = device
        # +page_size rows: slot 0 (padding) and, when paged, the rest of page 0.
        shape = (size + page_size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def cell_size_bytes(num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers (sizes the pool from a budget)."""
        return num_kv_heads * head_dim * num_layers * 2 * torch.empty(0, dtype=dtype).element_size()

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V of the tokens of this pass: loc [num_tokens], cache_k/v [num_tokens, kv_heads, head_dim]."""
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)
